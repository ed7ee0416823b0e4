"""Helpers shared by the architecture families: config reading with clear errors."""

from __future__ import annotations

import torch

from tiermoe.errors import TiermoeError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_dtype(cfg) -> torch.dtype:
    """The checkpoint dtype named by config.json (`dtype`, or the older `torch_dtype`); float32 when absent."""
    value = getattr(cfg, "dtype", None) or cfg.__dict__.get("torch_dtype")
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        # FP8 and other quantised releases keep their dtype in quantization_config; compute in bf16.
        return torch.bfloat16
    return _DTYPES[name]


def require(cfg, name: str):
    """A config field that must be present and not None."""
    value = getattr(cfg, name, None)
    if value is None:
        raise TiermoeError(f"config.json of model_type '{cfg.model_type}' has no '{name}', which it needs")
    return value
