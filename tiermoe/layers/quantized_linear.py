"""QuantizedLinear: an nn.Linear whose weight is held packed (bf16 / int8 / int4 / int6) and computed by the native
kernels.

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
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.experts.kernel_matmuls import PackedMatrix, packed_product
from tiermoe.experts.kernels import Kernels, ThreadTeam, TmLinearArgs
from tiermoe.experts.native import AMX_MIN_ROWS
from tiermoe.experts.quant import QMatrix, block, dequantize, quantize

_STORED = ("codes", "scale", "gscale", "gzero")  # the QMatrix tensors, held as (non-persistent) buffers


class QuantizedLinear(nn.Module):
    """Replaces `linear` (its weight quantised to `fmt` once, here); `kernels` None computes in torch.

    team: gives the model's kernel thread team (tiermoe.experts.native.kernel_team)."""

    def __init__(self, linear: nn.Linear, fmt: str, kernels: Kernels | None, team: Callable[[], ThreadTeam],
                 amx_min_rows: int = AMX_MIN_ROWS):
        super().__init__()
        with torch.no_grad():
            self._hold(block(quantize(linear.weight.detach(), fmt)), linear.bias, kernels, team, amx_min_rows)

    @classmethod
    def holding(cls, q: QMatrix, bias: nn.Parameter | None, kernels: Kernels | None, team: Callable[[], ThreadTeam],
                amx_min_rows: int = AMX_MIN_ROWS) -> QuantizedLinear:
        """A QuantizedLinear of a matrix already stored (blocked, one segment)."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        linear._hold(q, bias, kernels, team, amx_min_rows)
        return linear

    def _hold(self, q: QMatrix, bias, kernels, team, amx_min_rows) -> None:
        self.in_features, self.out_features, self.fmt = q.k, q.n, q.fmt
        self.kernels, self.team, self.amx_min_rows = kernels, team, amx_min_rows
        self.packed = PackedMatrix(q)
        for name in _STORED:  # buffers, so the model's own accounting (tier_bytes) sees what is held
            self.register_buffer(name, getattr(q, name), persistent=False)
        self.bias = bias

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


def bf16_product_args(linear: QuantizedLinear, kernels: Kernels) -> TmLinearArgs:
    """The kernels' arguments of `linear`'s product of bf16 rows, M, x and out left for the call to set: what the
    native chains (csrc/decode_layer.cpp, csrc/mla_decode.cpp) compute it with."""
    w = linear.packed
    return TmLinearArgs(isa=kernels.isa, amx_min_rows=linear.amx_min_rows, N=w.n, K=w.k, seg_rows=w.seg_rows,
                        seg_len=w.seg_len, x_bf16=1, W=w.c_ptr)


def stack_rows(linears: list[QuantizedLinear]) -> QuantizedLinear | None:
    """One QuantizedLinear whose product is the given ones' side by side ([..., k] -> [..., sum of their n], in
    their order): attention's q, k and v in one call instead of three and a concatenation. Their stored tensors are
    concatenated once and each given linear is re-pointed at its own rows of the result, so nothing is held twice;
    each output row is computed exactly as its own linear computes it (the kernels' strips of 16 rows are
    independent, and int8 / int4 quantise row by row). None when they do not stack: other formats or inputs, no
    kernels, biases on some only, or a linear whose rows are not whole strips."""
    first = linears[0]
    if (first.kernels is None or any(lin.kernels is not first.kernels for lin in linears)
            or len({(lin.fmt, lin.in_features) for lin in linears}) > 1
            or len({lin.bias is None for lin in linears}) > 1
            or any(lin.out_features % 16 or lin.packed.q.segments != ((0, lin.out_features),) for lin in linears)):
        return None
    qs = [lin.packed.q for lin in linears]
    with torch.no_grad():
        stored = {name: None if getattr(first.packed.q, name) is None else torch.cat([getattr(q, name) for q in qs])
                  for name in _STORED}
        n = sum(q.n for q in qs)
        stacked = replace(qs[0], n=n, segments=((0, n),), segment_rows=n, **stored)
        bias = None if first.bias is None else nn.Parameter(torch.cat([lin.bias for lin in linears]),
                                                            requires_grad=False)
        start = 0
        for lin, q in zip(linears, qs):
            rows = slice(start, start + q.n)
            strips = slice(start // 16, (start + q.n) // 16)  # codes, gscale, gzero: [strips, ...]; scale: [rows]
            views = {name: None if t is None else t[rows if name == "scale" else strips] for name, t in stored.items()}
            lin._hold(replace(q, **views), None if bias is None else nn.Parameter(bias[rows], requires_grad=False),
                      lin.kernels, lin.team, lin.amx_min_rows)
            start += q.n
    return QuantizedLinear.holding(stacked, bias, first.kernels, first.team, first.amx_min_rows)
