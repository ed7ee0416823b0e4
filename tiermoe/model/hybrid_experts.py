"""HybridExperts: the two tiers in place of a MoE block's experts module, for blocks whose forward stays the model's.

A family tiermoe has not tuned (tiermoe.arch.tuned) keeps its own MoE block: the model's code routes (softmax,
sigmoid, grouped or hashed top-k, scalings), computes its shared experts and whatever else the block does, and
calls `self.experts(hidden [T, D], top_k_index [T, K], top_k_weights [T, K])`, transformers' experts interface.
That call lands here: the routed experts of both tiers, split by ownership as HybridMoE splits them, with the
CPU part computing on its worker while the GPU part runs. So every placement gives the model's own output; the
shared experts run after the routed ones instead of beside the CPU tier (HybridMoE's overlap), the price of not
knowing the block's arithmetic. Everything that moves, records or plans experts sees a HybridMoE.
Legend: T tokens, D hidden, K top-k.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from tiermoe.arch.spec import ArchSpec
from tiermoe.experts.tiers import CPUExpertBackend, ExpertSet
from tiermoe.layers.hybrid_moe import HybridMoE


class HybridExperts(HybridMoE):
    def __init__(self, spec: ArchSpec, layer: int, gpu_tier: ExpertSet, cpu_tier: CPUExpertBackend):
        # no router or shared experts here: the block around this module keeps them
        super().__init__(nn.Module(), replace(spec, shared_kind="none", shared_intermediate_size=0), layer, gpu_tier,
                         cpu_tier)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,  # type: ignore[override]
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """Sum of each token's routed experts, weighted: [T, D] (what the experts module returned)."""
        x_TD, ids_TK, weights_TK = hidden_states, top_k_index.long(), top_k_weights
        if self.recorder.enabled:
            self.recorder.record(self.layer, ids_TK, self.assignment_E >= 0)
        if self.cpu_only_shortcut and len(self.gpu_tier) == 0 and self.reduce is None and self._plain_inference():
            y_TD, _ = self._cpu_only(x_TD, ids_TK, weights_TK)
        else:
            rank_TK = self.assignment_E[ids_TK]
            on_gpu_TK = rank_TK >= 0
            mine_TK = on_gpu_TK if self.reduce is None else rank_TK == self.rank
            if self.lora_experts is not None or (self.trainable and torch.is_grad_enabled()):
                y_TD = self._routed_differentiable(x_TD, ids_TK, weights_TK, on_gpu_TK, mine_TK)
            else:
                y_TD, _ = self._routed_overlapped(x_TD, ids_TK, weights_TK, on_gpu_TK, mine_TK)
        if self.reduce is not None:
            y_TD = self.reduce(y_TD)
        return y_TD.to(hidden_states.dtype)
