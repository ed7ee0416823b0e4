"""Architecture registry: model_type -> ArchSpec builder, and detection from a checkpoint's config.json."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig

from tiermoe.arch import deepseek, gpt_oss, mixtral, olmoe, qwen
from tiermoe.arch.gguf_config import config_fields_from_gguf
from tiermoe.arch.spec import ArchSpec, ExpertDiskLayout
from tiermoe.checkpoint.gguf_reader import GGUFFiles
from tiermoe.errors import TiermoeError

BUILDERS = {
    "qwen2_moe": qwen.build_spec,
    "qwen3_moe": qwen.build_spec,
    "qwen3_next": qwen.build_spec,
    "mixtral": mixtral.build_spec,
    "deepseek_v2": deepseek.build_spec,
    "deepseek_v3": deepseek.build_spec,
    "glm4_moe": deepseek.build_spec,
    "olmoe": olmoe.build_spec,
    "gpt_oss": gpt_oss.build_spec,
}
SUPPORTED_MODEL_TYPES = tuple(BUILDERS)

# Config fields that name a routed-expert count in some MoE family: a model with one of them > 0 is MoE.
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

__all__ = ["ArchSpec", "ExpertDiskLayout", "SUPPORTED_MODEL_TYPES", "detect", "load_config", "text_config"]


def _supported_list() -> str:
    return ", ".join(SUPPORTED_MODEL_TYPES)


def text_config(cfg):
    """The config that describes the language model: `cfg` itself, or its nested `text_config`."""
    if cfg.model_type in BUILDERS:
        return cfg
    nested = getattr(cfg, "text_config", None)
    if nested is not None and getattr(nested, "model_type", None) in BUILDERS:
        return nested
    return cfg


def detect(cfg) -> ArchSpec:
    """ArchSpec of a transformers config (or of its nested `text_config`).

    Raises TiermoeError, one line listing the supported model types, for unsupported or dense models.
    """
    cfg = text_config(cfg)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in BUILDERS:
        is_moe = any((getattr(cfg, f, 0) or 0) > 0 for f in _EXPERT_COUNT_FIELDS)
        kind = "an unsupported MoE model_type" if is_moe else "a dense (non-MoE) or unsupported model_type"
        raise TiermoeError(f"'{model_type}' is {kind}; tiermoe supports: {_supported_list()}")
    spec_or_none = _build(cfg)
    if spec_or_none is None:
        raise TiermoeError(
            f"this {model_type} config has no MoE layers (a dense model); tiermoe runs MoE models of types: "
            f"{_supported_list()}"
        )
    return spec_or_none


def _build(cfg) -> ArchSpec | None:
    try:
        return BUILDERS[cfg.model_type](cfg)
    except ValueError as err:  # ArchSpec refuses zero MoE layers
        if isinstance(err, TiermoeError):
            raise
        return None


def load_gguf_config(path: str | Path):
    """The transformers config of a GGUF model (one file, or a directory of split files), from its metadata.

    GGUF weights are converted at load, so the compute dtype is bf16 unless the caller asks for another."""

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
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, TypeError) as err:
        model_type = raw.get("model_type")
        if model_type not in BUILDERS:
            raise TiermoeError(f"'{model_type}' is an unsupported model_type; tiermoe supports: {_supported_list()}") from None
        raise TiermoeError(f"{config_file} could not be read as a {model_type} config: {err}") from None
