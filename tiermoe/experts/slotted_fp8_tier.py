"""The GPU tier of an FP8 layer as slots of a pool, computed by the Triton grouped GEMM on the FP8 codes: no host
sync, and the experts stay about 1 byte per parameter.

Why: expert by expert (tiermoe.experts.fp8_tier) each forward dequantises every expert it uses before the matmul
reads it again, and costs the host 3 + g syncs per layer per step. Here the codes and block scales of gate, up and
down live in slots of a pool of their own (the fields of FP8ExpertWeights, stacked), and the kernel decodes the
codes as it reads them (tiermoe.experts.triton_grouped), with the dequantisation rule of the checkpoint reader.
Gate and up stay apart, as released: their blocks differ unless I is a multiple of the block height.

Everything else is SlottedExpertSet's: the window of slots a layer holds, swaps that hand a slot over (between FP8
layers too), `get` that dequantises for a move and `add` that quantises an arriving canonical expert back, as
FP8ExpertSet does. Where the pool's kernel is not the Triton one (a CPU device), experts compute one at a time,
dequantised, as FP8ExpertSet computes them. Legend as in tiermoe.experts.slotted_tier.
"""

from __future__ import annotations

import torch

from tiermoe.experts import triton_grouped
from tiermoe.experts.ffn import (
    ConvertedOnLookup,
    ExpertActivation,
    routed_experts_forward,
)
from tiermoe.experts.fp8_tier import FP8ExpertWeights, as_fp8
from tiermoe.experts.slot_pool import ExpertSlotPool
from tiermoe.experts.slotted_tier import SlottedExpertSet
from tiermoe.experts.weights import ExpertWeights


class SlottedFP8ExpertSet(SlottedExpertSet):
    """The FP8 experts one GPU tier holds for one layer, in slots of `pool` (shared by the model's FP8 layers);
    `dtype` is what `get` dequantises to (the model's compute dtype, the layout tier swaps move)."""

    def __init__(self, act: ExpertActivation, num_experts: int, pool: ExpertSlotPool, block: tuple[int, int],
                 dtype: torch.dtype):
        super().__init__(act, num_experts, pool)
        self.block = tuple(block)
        self.dtype = dtype

    def add(self, expert: int, weights: ExpertWeights | FP8ExpertWeights) -> None:
        super().add(expert, as_fp8(weights, self.block))

    def _held(self, views) -> FP8ExpertWeights:
        return FP8ExpertWeights(*views, self.block)

    def get(self, expert: int) -> ExpertWeights:
        return self.experts[expert].dequantized(self.dtype)

    def pop(self, expert: int) -> ExpertWeights:
        weights = self.get(expert)  # dequantised before the slot goes back to the pool
        super().pop(expert)
        return weights

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        if self.experts and self.pool.kernel(x_TD.dtype).name != "triton":
            experts = ConvertedOnLookup(self.experts, lambda w: w.dequantized(x_TD.dtype))  # one at a time
            return routed_experts_forward(experts, x_TD, ids_TK, weights_TK, self.act)
        return super().forward(x_TD, ids_TK, weights_TK)

    def _triton(self, x_TD, group_P, group_sorted_P, token_P, window, width) -> torch.Tensor:
        gate_WIH, gate_scale, up_WIH, up_scale, down_WHI, down_scale = window
        layout = triton_grouped.grouped_rows(group_sorted_P, token_P, width)
        gate_RI = triton_grouped.grouped_matmul(x_TD, layout, gate_WIH, scale_Wnk=gate_scale, scale_block=self.block)
        up_RI = triton_grouped.grouped_matmul(x_TD, layout, up_WIH, scale_Wnk=up_scale, scale_block=self.block)
        a_RI = self.act(torch.cat([gate_RI, up_RI], dim=-1))  # the canonical gate_up layout: gate first
        y_RD = triton_grouped.grouped_matmul(a_RI, layout, down_WHI, rows_R=layout.own_rows(), scale_Wnk=down_scale,
                                             scale_block=self.block)
        return layout.pair_rows(y_RD)
