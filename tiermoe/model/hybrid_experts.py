"""HybridExperts: the two tiers in place of a MoE block's experts module, for blocks whose forward stays the model's.

A family tiermoe has not tuned (tiermoe.arch.tuned) keeps its own MoE block: the model's code routes (softmax,
sigmoid, grouped or hashed top-k, scalings), computes its shared experts and whatever else the block does, and
calls its experts module. That call lands here: the routed experts of both tiers, split by ownership as HybridMoE
splits them, with the CPU part computing on its worker while the GPU part runs. So every placement gives the
model's own output; the shared experts run after the routed ones instead of beside the CPU tier (HybridMoE's
overlap), the price of not knowing the block's arithmetic. Everything that moves, records or plans experts sees a
HybridMoE. How the block calls its experts (tiermoe.arch.spec.EXPERTS_CALLS):
- "interface": `experts(hidden [T, D], top_k_index [T, K], top_k_weights [T, K])`: HybridExperts takes the
  module's place;
- "around": the module's own forward works around that call (Ergo: a learned RMSNorm per expert on each route's
  output): the module stays with its own state, its class swapped for a subclass whose interface call is the
  tiers' (`experts_around`), its fused weights dropped (the tiers hold them);
- "every_expert": `experts(x [E * T, D])`, every expert's copy of every token scaled by its routing weight
  (Llama-4): HybridEveryExpert takes the module's place and computes the K picked rows of each token.
Legend: T tokens, D hidden, K top-k, E experts, N routed rows.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import nn

from tiermoe.arch.experts_form import FUSED_NAMES, interface_class
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
        self.record(top_k_index)
        return self.routed(hidden_states, top_k_index.long(), top_k_weights)

    def record(self, ids_TK: torch.Tensor) -> None:
        if self.recorder.enabled:
            self.recorder.record(self.layer, ids_TK.long(), self.assignment_E >= 0)

    def routed(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each row's routed experts [T, D], on both tiers (nothing recorded); rows of
        adapters served per request with their expert LoRA (HybridMoE._routed_with_adapters)."""
        y_TD, _ = self._routed_with_adapters(x_TD, ids_TK, weights_TK)
        if self.reduce is not None:
            y_TD = self.reduce(y_TD)
        return y_TD.to(x_TD.dtype)


class HybridEveryExpert(HybridExperts):
    """The tiers for an experts module called with every expert's copy of every token (EXPERTS_CALLS
    "every_expert"). The router scaled the copies of the experts it did not pick by 0, and such a row gives 0
    (experts without biases: up(0) = 0), so each token's K rows scaled by anything else are computed, each once
    with weight 1 (the block scaled its input already), and the rest stay 0."""

    def forward(self, routed_in: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """[E * T, D] -> [E * T, D], expert-major (the block sums the E blocks of T rows)."""
        x_ETD = routed_in.view(self.spec.num_experts, -1, routed_in.shape[-1])
        t, k = x_ETD.shape[1], self.spec.top_k
        # the K rows of each token the router did not zero; a weight that underflowed to 0 leaves a zero row among
        # them, which gives 0 as the module's own forward does
        ids_TK = x_ETD.ne(0).any(-1).t().to(routed_in.dtype).topk(k, dim=-1).indices
        tokens_TK = torch.arange(t, device=routed_in.device)[:, None].expand(t, k)
        self.record(ids_TK)
        x_ND = x_ETD[ids_TK, tokens_TK].flatten(0, 1)
        y_ND = self.routed(x_ND, ids_TK.reshape(-1, 1), x_ND.new_ones(t * k, 1))
        out_ETD = torch.zeros_like(x_ETD)
        out_ETD[ids_TK, tokens_TK] = y_ND.view(t, k, -1)
        return out_ETD.view_as(routed_in)


def experts_around(experts: nn.Module, tiers: HybridExperts) -> nn.Module:
    """`experts` (EXPERTS_CALLS "around") computing its interface call on `tiers`: its class swapped for a subclass
    whose interface call is the tiers' (the module's own forward and other state kept, its fused weights dropped),
    `tiers` its child. The module's own forward records the block's routing, once, as HybridExperts would."""
    for name in FUSED_NAMES:
        experts._parameters.pop(name, None)
    experts.__class__ = _around_class(type(experts))
    experts.tiers = tiers
    return experts


@functools.cache  # one subclass per original class, so every swapped module shares it
def _around_class(cls: type) -> type:
    interface = interface_class(cls)
    # placed between `cls` and the interface class in the MRO: `super().forward` in cls's own forward lands here
    tiers_call = type(f"TiersOf{interface.__name__}", (interface,), {"forward": _tiers_call})

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        self.tiers.record(top_k_index)
        return cls.forward(self, hidden_states, top_k_index, top_k_weights)

    return type(f"Hybrid{cls.__name__}", (cls, tiers_call), {"forward": forward})


def _tiers_call(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    return self.tiers.routed(hidden_states, top_k_index.long(), top_k_weights)
