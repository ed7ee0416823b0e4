"""Architecture detection: a checkpoint's config.json -> ArchSpec, discovered from transformers' own modules.

transformers is imported by the functions that read a config or build modules, not by this package: `ArchSpec`
and the rest of `tiermoe.arch` are imported by commands that only plan or read statistics (`tiermoe place
--num-layers ...`, `tiermoe stats`), which then start without transformers' import (a second or more).
"""

from __future__ import annotations

import json
from pathlib import Path

from tiermoe.arch.derive import spec_of
from tiermoe.arch.discover import discover
from tiermoe.arch.gguf_config import config_fields_from_gguf
from tiermoe.arch.spec import ArchSpec, ExpertDiskLayout
from tiermoe.arch.tuned import TUNED
from tiermoe.arch.zoo import causal_lm_types, defines_experts
from tiermoe.checkpoint.gguf_reader import GGUFFiles
from tiermoe.errors import TiermoeError

# The families tiermoe has tuned (HybridMoE's own block forward, the fused native decode layers, released disk
# layouts); every other MoE causal LM of the installed transformers runs too, discovered from its modules.
SUPPORTED_MODEL_TYPES = tuple(TUNED)

__all__ = ["SUPPORTED_MODEL_TYPES", "ArchSpec", "ExpertDiskLayout", "detect", "load_config", "text_config"]


def _supported_list() -> str:
    return ", ".join(SUPPORTED_MODEL_TYPES)


def _runs() -> str:
    return f"tiermoe supports every MoE causal LM of the installed transformers (tuned: {_supported_list()})"


def text_config(cfg):
    """The config that describes the language model: `cfg` itself, or its nested `text_config` (a composite
    config, e.g. a vision-language wrapper, whose text part is a causal LM of its own)."""
    nested = getattr(cfg, "text_config", None)
    if nested is not None and getattr(nested, "model_type", None) in causal_lm_types():
        return nested
    return cfg


def detect(cfg) -> ArchSpec:
    """ArchSpec of a transformers config (or of its nested `text_config`), discovered from the model's modules
    built on the meta device (tiermoe.arch.discover), with a tuned family's overrides (tiermoe.arch.tuned).

    Raises TiermoeError, one line, for dense models and model types transformers does not define.
    """
    cfg = text_config(cfg)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in causal_lm_types():
        raise TiermoeError(f"'{model_type}' is an unsupported model_type (not a causal LM of transformers "
                           f"{_transformers_release()}); {_runs()}")
    if model_type not in TUNED and not defines_experts(model_type):
        raise TiermoeError(f"'{model_type}' is a dense (non-MoE) model_type: its modeling file has no fused experts "
                           f"module; {_runs()}")
    found = discover(cfg)
    return spec_of(cfg, found)


def _transformers_release() -> str:
    import transformers

    return transformers.__version__


def load_gguf_config(path: str | Path):
    """The transformers config of a GGUF model (one file, or a directory of split files), from its metadata.

    GGUF weights are converted at load, so the compute dtype is bf16 unless the caller asks for another."""

    from transformers import AutoConfig

    files = GGUFFiles(path)
    fields = config_fields_from_gguf(files.metadata, set(files.tensors))
    return AutoConfig.for_model(fields.pop("model_type"), dtype="bfloat16", **fields)


def load_config(model_dir: str | Path):
    """Read `model_dir/config.json` into a transformers config, with one-line errors for every bad input."""

    path = Path(model_dir)
    if not path.exists():
        raise TiermoeError(f"model path '{path}' does not exist; expected a Hugging Face checkpoint directory")
    if path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))):
        return load_gguf_config(path)
    if not path.is_dir():
        raise TiermoeError(f"model path '{path}' is not a directory; expected a checkpoint directory with config.json")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise TiermoeError(f"'{path}' has no config.json; expected a Hugging Face checkpoint directory")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TiermoeError(f"{config_file} is not valid JSON ({err})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise TiermoeError(f"{config_file} has no 'model_type'; expected a transformers config")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, TypeError) as err:
        model_type = raw.get("model_type")
        if model_type not in causal_lm_types():
            raise TiermoeError(f"'{model_type}' is an unsupported model_type; {_runs()}") from None
        raise TiermoeError(f"{config_file} could not be read as a {model_type} config: {err}") from None
