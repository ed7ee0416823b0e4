"""LoRA on one MoE layer's routed experts: low-rank updates of every expert's gate_up and down projections.

The factors are PEFT's per-expert ones (`ParamWrapper` on a fused [E, out, in] expert parameter): expert e's
projection W_e becomes W_e + scaling * B_e @ A_e. They are applied as two thin products on the rows routed to the
expert (x A_e^T B_e^T), never as a merged [out, in] weight, so no copy of the frozen experts exists on either tier.
Legend: E experts, D hidden, I intermediate, r rank.

Parameter names contain "lora_" (the block holds this module as `lora_experts`), which is how PEFT tells adapter
weights from frozen ones: `get_peft_model` on a model that already has these keeps them trainable.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class ExpertLoRA(nn.Module):
    """gate_up_A [E, r_gu, D], gate_up_B [E, 2I, r_gu], down_A [E, r_d, I], down_B [E, D, r_d], each projection with
    its own rank and scaling (alpha / r, or alpha / sqrt(r) with rslora): PEFT gives the fused gate_up twice the rank
    (and alpha) of down when it maps transformers v4 targets (gate_proj + up_proj) onto the fused parameter."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, ranks: tuple[int, int],
                 alphas: tuple[float, float], rslora: bool = False, device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        if min(ranks) < 1:
            raise ValueError(f"LoRA ranks must be >= 1, got {ranks}")
        self.ranks, self.alphas = tuple(ranks), tuple(alphas)
        self.scalings = tuple(a / (math.sqrt(r) if rslora else r) for r, a in zip(ranks, alphas))
        E, D, I = num_experts, hidden, intermediate  # noqa: E741
        (r_gu, r_d) = ranks
        make = (lambda *shape: nn.Parameter(torch.empty(*shape, device=device, dtype=dtype)))
        self.gate_up_A, self.gate_up_B = make(E, r_gu, D), make(E, 2 * I, r_gu)
        self.down_A, self.down_B = make(E, r_d, I), make(E, D, r_d)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PEFT's default initialisation: A as nn.Linear's (Kaiming-uniform), B zero, so training starts at the
        frozen model exactly."""
        for a in (self.gate_up_A, self.down_A):
            bound = 1 / math.sqrt(a.shape[-1])  # kaiming_uniform_(a=sqrt(5)) on an [r, in] weight
            nn.init.uniform_(a, -bound, bound)
        for b in (self.gate_up_B, self.down_B):
            nn.init.zeros_(b)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate_up_A, self.gate_up_B, self.down_A, self.down_B

    def extra_repr(self) -> str:
        E, _, D = self.gate_up_A.shape
        return (f"experts={E}, hidden={D}, intermediate={self.down_A.shape[-1]}, ranks={self.ranks}, "
                f"scalings={tuple(round(s, 6) for s in self.scalings)}")
