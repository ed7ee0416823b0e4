"""QuantizedLinear: an nn.Linear whose weight is held packed (bf16 / int8 / int4) and computed by the native kernels.

For CPU-only runs (`--non-expert-dtype`, gpu_device "cpu"): a decode step reads every non-expert weight once, so
storing them as the CPU tier stores its experts (tiermoe.experts.quant: int8 per row, int4 in groups of 32,
"blocked" for the kernels) cuts the bytes a token reads the way a llama.cpp Q4_K_M file does. The product is
`tm_linear_forward` through tiermoe.experts.kernel_matmuls.packed_product, the function the CPU tier's expert
products use, on the model's kernel thread team (its lock orders these calls with the MoE layers the CPU worker
computes). Activations stay in the model's dtype (fp32 or bf16 computed as such; others in fp32 and cast back);
accumulation is fp32. The bias, if any, stays a Parameter named `bias` in the model's dtype.

Swapped in by tiermoe.model.non_expert_quant after the weights are loaded, the way HybridMoE replaces MoE blocks.
Without the kernels (no compiler, TIERMOE_CPU_ISA=torch) it keeps the same stored format and multiplies by the
weight dequantised per call: slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.experts.kernel_matmuls import PackedMatrix, packed_product
from tiermoe.experts.kernels import Kernels, ThreadTeam
from tiermoe.experts.native import AMX_MIN_ROWS
from tiermoe.experts.quant import block, dequantize, quantize

_STORED = ("codes", "scale", "gscale", "gzero")  # the QMatrix tensors, held as (non-persistent) buffers


class QuantizedLinear(nn.Module):
    """Replaces `linear` (its weight quantised to `fmt` once, here); `kernels` None computes in torch.

    team: gives the model's kernel thread team (tiermoe.experts.native.kernel_team)."""

    def __init__(self, linear: nn.Linear, fmt: str, kernels: Kernels | None, team: Callable[[], ThreadTeam],
                 amx_min_rows: int = AMX_MIN_ROWS):
        super().__init__()
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        self.kernels, self.team, self.amx_min_rows = kernels, team, amx_min_rows
        with torch.no_grad():
            self.packed = PackedMatrix(block(quantize(linear.weight.detach(), fmt)))
        for name in _STORED:  # buffers, so the model's own accounting (tier_bytes) sees what is held
            self.register_buffer(name, getattr(self.packed.q, name), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is None:
            y = F.linear(x, self.dequantized(x.dtype))
        else:
            y = packed_product(self.kernels, self.team(), self.packed, x, amx_min_rows=self.amx_min_rows)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out_features, in_features] in `dtype`, for this call only."""
        return dequantize(self.packed.q, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fmt={self.fmt}")
