"""A checkpoint's sampling defaults (generation_config.json), used wherever a request leaves a field out.

vLLM (`--generation-config auto`) and SGLang (`--sampling-defaults model`) both take temperature, top_p and top_k
from the checkpoint's generation_config.json for every request that does not give them, and ignore `do_sample`;
tiermoe does the same in every entry point (the Python API when no SamplingParams is passed, the CLI, and the
OpenAI, SGLang and Ollama endpoints). A value given explicitly always wins, and an explicit `SamplingParams()` is
greedy as documented. `max_new_tokens` is the Python API's default max_tokens (vLLM's LLM does the same).
min_p and repetition_penalty, which tiermoe does not sample with, are left out (with one warning).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tiermoe.engine.sampling import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k")
UNSUPPORTED = {"min_p": 0.0, "repetition_penalty": 1.0}  # field -> the value that means "off"


def _valid(name: str, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if name == "temperature":
        return value >= 0
    if name == "top_p":
        return 0 < value <= 1
    return isinstance(value, int) and value >= 0  # top_k, max_new_tokens


@dataclass(frozen=True)
class GenerationDefaults:
    """What generation_config.json sets validly: `sampling` holds temperature / top_p / top_k (those present),
    `max_tokens` its max_new_tokens."""

    sampling: dict = field(default_factory=dict)
    max_tokens: int | None = None

    def params(self, fallback: dict | None = None, **given) -> SamplingParams:
        """SamplingParams from the values `given` (None = not given), else these defaults, else the entry point's
        own `fallback` (e.g. the OpenAI API's temperature 1.0), else SamplingParams' own defaults."""
        return SamplingParams(**{**(fallback or {}), **self.sampling,
                                 **{k: v for k, v in given.items() if v is not None}})


def load_generation_defaults(model_dir: Path) -> GenerationDefaults:
    """The checkpoint's defaults (a value out of range is skipped with a warning); none without the file."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return GenerationDefaults()  # an unreadable file is reported where the EOS ids are read from it
    if not isinstance(config, dict):
        return GenerationDefaults()
    found = {}
    for name in (*SAMPLING_FIELDS, "max_new_tokens"):
        if name not in config:
            continue
        if _valid(name, config[name]) and not (name == "max_new_tokens" and config[name] < 1):
            found[name] = config[name]
        else:
            warnings.warn(f"{path}: {name} {config[name]!r} is not a valid sampling default; ignored", stacklevel=2)
    ignored = [name for name, off in UNSUPPORTED.items() if config.get(name) not in (None, off)]
    if ignored:
        warnings.warn(f"{path}: {', '.join(ignored)} not applied (tiermoe samples with temperature, top_p and top_k "
                      "only)", stacklevel=2)
    max_tokens = found.pop("max_new_tokens", None)
    return GenerationDefaults({k: float(v) if k != "top_k" else v for k, v in found.items()}, max_tokens)
