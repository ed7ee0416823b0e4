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


def qwen_style_moe_layers(cfg, num_experts: int) -> tuple[int, ...]:
    """Qwen2/3-MoE and Qwen3-Next: MoE iff not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0."""
    only_mlp = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    if num_experts <= 0:
        return ()
    return tuple(i for i in range(cfg.num_hidden_layers) if i not in only_mlp and (i + 1) % step == 0)


def deepseek_style_moe_layers(cfg) -> tuple[int, ...]:
    """DeepSeek-V2/V3 and GLM4-MoE: MoE from `first_k_dense_replace` on.

    The original DeepSeek code also skips layers where `layer % moe_layer_freq != 0`; transformers does not
    implement that, and every released checkpoint uses 1, so any other value is refused rather than misread.
    """
    freq = getattr(cfg, "moe_layer_freq", 1) or 1
    if freq != 1:
        raise TiermoeError(
            f"moe_layer_freq={freq} is not supported (transformers builds every layer from first_k_dense_replace on "
            "as MoE); expected 1"
        )
    first = getattr(cfg, "first_k_dense_replace", 0) or 0
    return tuple(range(first, cfg.num_hidden_layers))
