"""One routed expert's four products, forward and transposed: what a backward pass through a tier needs.

Legend: N rows routed to the expert, D hidden, I intermediate. For weights W_gu [2I, D] and W_d [D, I]:
  gate_up(x_ND)   = x W_gu^T (+ bias)  -> [N, 2I]     down(a_NI)     = a W_d^T (+ bias) -> [N, D]
  gate_up_t(g_N2I) = g W_gu            -> [N, D]      down_t(g_ND)   = g W_d            -> [N, I]
The transposed products are the input gradients of the forward ones (biases have none); training computes every
expert through them, so a tier decides how (dequantised torch matmuls here; packed kernels where a tier has them).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from tiermoe.experts.weights import ExpertWeights


class ExpertMatmuls(Protocol):
    def gate_up(self, x_ND: torch.Tensor) -> torch.Tensor: ...

    def down(self, a_NI: torch.Tensor) -> torch.Tensor: ...

    def gate_up_t(self, g_N2I: torch.Tensor) -> torch.Tensor: ...

    def down_t(self, g_ND: torch.Tensor) -> torch.Tensor: ...


class TorchMatmuls:
    """The reference: plain torch products on the expert's canonical weights, cast to the activations' dtype."""

    def __init__(self, weights: ExpertWeights, dtype: torch.dtype):
        self.w = weights if weights.gate_up.dtype == dtype else ExpertWeights(
            *(None if t is None else t.to(dtype) for t in
              (weights.gate_up, weights.down, weights.gate_up_bias, weights.down_bias)))

    def gate_up(self, x_ND: torch.Tensor) -> torch.Tensor:
        return F.linear(x_ND, self.w.gate_up, self.w.gate_up_bias)

    def down(self, a_NI: torch.Tensor) -> torch.Tensor:
        return F.linear(a_NI, self.w.down, self.w.down_bias)

    def gate_up_t(self, g_N2I: torch.Tensor) -> torch.Tensor:
        return g_N2I @ self.w.gate_up

    def down_t(self, g_ND: torch.Tensor) -> torch.Tensor:
        return g_ND @ self.w.down


def matmuls_of(tier, expert: int, dtype: torch.dtype) -> ExpertMatmuls:
    """The products of `expert` as `tier` computes them: the tier's own (`tier.matmuls`) when it has them, else
    torch on its canonical weights (`tier.get`, dequantised by tiers that store another format)."""
    own = getattr(tier, "matmuls", None)
    if own is not None:
        found = own(expert, dtype)
        if found is not None:
            return found
    return TorchMatmuls(tier.get(expert), dtype)
