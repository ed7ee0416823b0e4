"""FP8 block-quantised checkpoints, as DeepSeek-V3/R1 and the Qwen3 FP8 releases store them.

The block math is in tiermoe.experts.fp8_blocks. config.json names the scheme in `quantization_config`
({"quant_method": "fp8", "weight_block_size": [128, 128], ...}); each FP8 tensor `x.weight` has its scales
beside it as `x.weight_scale_inv`.

Design: non-expert Linear weights stay FP8 on the main device (`FP8Linear`, about 1 byte per parameter plus
4 bytes per block) and are dequantised inside the forward, one matrix at a time, to the activation's dtype. That
costs a transient matrix per Linear call but keeps the resident weights at half of bf16; where CUDA supports FP8
matmuls, `torch._scaled_mm` would avoid even that (not used yet: it needs per-token activation scaling to match
this reference exactly). GPU-tier experts stay FP8 the same way (tiermoe.experts.fp8_tier); CPU-tier experts are
dequantised one at a time while they stream from disk (see `Checkpoint.read`), then take the CPU tier's format.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.errors import TiermoeError
from tiermoe.experts.fp8_blocks import FP8_DTYPES, dequantize_fp8

SCALE_SUFFIX = "_scale_inv"

# Linear weights of decoder layers, not the router (`.mlp.gate.weight`, Mixtral's `.block_sparse_moe.gate.`)
_QUANTISED = re.compile(r"^model\.layers\.\d+\..*\.weight$")
_KEPT = re.compile(r"(norm|\.gate\.weight$|shared_expert_gate\.weight$)")


def is_fp8_quantised(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the released FP8 layout stores tensor `name` as FP8 (2-D decoder Linear weights, routers aside)."""
    return len(shape) == 2 and bool(_QUANTISED.match(name)) and not _KEPT.search(name)


def fp8_block_size(config) -> tuple[int, int] | None:
    """(bn, bk) of an FP8 block-quantised config, None when the checkpoint is not FP8.

    Raises TiermoeError for FP8 schemes tiermoe does not read (per-tensor or per-channel scales)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = str(qc.get("quant_method", "")).lower()
    if method != "fp8":
        raise TiermoeError(f"quantization_config.quant_method '{method}' is not supported; tiermoe reads "
                           "bf16/fp16/fp32 checkpoints, FP8 block-quantised ones (quant_method 'fp8') and GGUF files")
    block = qc.get("weight_block_size")
    if block is None:
        raise TiermoeError("this FP8 checkpoint has no weight_block_size (per-tensor FP8); tiermoe reads "
                           "block-quantised FP8 (weight_block_size [128, 128], as DeepSeek-V3 and Qwen3-FP8 ship)")
    if len(block) != 2 or min(block) < 1:
        raise TiermoeError(f"quantization_config.weight_block_size must be two positive ints, got {block}")
    return int(block[0]), int(block[1])


def is_block_fp8(ckpt, disk: str | None) -> bool:
    """Checkpoint `ckpt` stores tensor `disk` as FP8 codes with block scales beside it (kept FP8 when loaded)."""
    entry = ckpt.entries.get(disk) if disk else None
    return entry is not None and entry.dtype in FP8_DTYPES and scale_name(disk) in ckpt


def scale_name(weight_name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv` (the released names)."""
    return weight_name + SCALE_SUFFIX


class FP8Linear(nn.Module):
    """A Linear layer whose weight stays FP8 with block scales; dequantised to the input's dtype per call.

    weight: e4m3 [out, in] (a parameter, so parameter counts and byte counts see it);
    weight_scale_inv: fp32 [ceil(out/bn), ceil(in/bk)]; bias: optional, in the model's dtype.
    """

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype not in FP8_DTYPES:
            raise ValueError(f"FP8Linear needs an FP8 weight, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.block = tuple(block)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(weight_scale_inv.to(torch.float32), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fp8 block={self.block[0]}x{self.block[1]}, bias={self.bias is not None}")
