"""Expert caches as placement policies: what users get elsewhere (llama.cpp's and MoE-Infinity's LRU expert
caches, LFU), on tiermoe's two tiers, with a copy budget per step.

A cache in a tiered engine differs from one in front of a slow disk: a miss is not waited for, the CPU tier
computes it. What the cache decides is which experts to promote after a pass: at most `copy_budget` swaps under way
at once (queued or copying; each a promotion and a demotion in one layer, so every layer keeps its GPU count), never
touching an expert whose copy is in flight. Under way, not per pass: a swap takes two steps in the engine (demotion,
then promotion: tiermoe.placement.swap_schedule), whose copies it runs a few at a time, and adaptive's budget
(max_swaps_in_flight) counts the same way, so every policy gets the same copies. The policies share the interface
of tiermoe.placement.policies (observe, propose), so the live engine and trace replay can drive them alike.

- `lru`: promote the experts the last pass routed to on the CPU tier (most routed pairs first), evicting the
  layer's least recently used GPU expert that the last pass did not use; the oldest victims across layers first.
- `lfu`: promote a CPU expert the last pass used when it has been routed to more often, since the start, than the
  layer's least frequently used GPU expert; largest difference first.
Ties go to the lower layer and expert id. Legend: L layers (MoE layers of the trace), E experts.
"""

from __future__ import annotations

import torch

from tiermoe.placement.policies import Swap

DEFAULT_COPY_BUDGET = 4  # swaps a cache may have under way at once
NONE = float("-inf")  # the score of an expert that is no candidate


def pair_swaps(in_score_LE: torch.Tensor, out_score_LE: torch.Tensor, pair_score, budget: int) -> list[Swap]:
    """The `budget` best swaps: in each layer the r-th best candidate to promote (highest in_score, finite) is
    paired with the r-th best victim (highest out_score, finite); `pair_score(in_LR, out_LR)` ranks the pairs
    across layers (pairs scoring <= 0 are dropped). Scores of -inf mark experts that are no candidate. Ties
    follow torch.topk (deterministic on the CPU)."""
    if budget <= 0:
        return []
    r = min(budget, in_score_LE.shape[1])
    in_val, in_idx = torch.topk(in_score_LE, r, dim=1)  # the r best of each layer, best first
    out_val, out_idx = torch.topk(out_score_LE, r, dim=1)
    score = pair_score(in_val, out_val)
    score = torch.where(torch.isfinite(in_val) & torch.isfinite(out_val) & (score > 0), score, NONE)
    best_val, best = torch.topk(score.flatten(), r)
    swaps = []
    for value, pos in zip(best_val.tolist(), best.tolist()):
        if value == NONE:
            break
        layer, rank = divmod(pos, r)
        swaps.append(Swap(layer, int(in_idx[layer, rank]), int(out_idx[layer, rank])))
    return swaps


def room(copy_budget: int, busy_LE: torch.Tensor) -> int:
    """Swaps a policy may still propose: its budget less the swaps under way (two busy experts each)."""
    return max(0, copy_budget - int(busy_LE.sum()) // 2)


class _Cache:
    def __init__(self, num_layers: int, num_experts: int, copy_budget: int = DEFAULT_COPY_BUDGET):
        if copy_budget < 0:
            raise ValueError(f"copy_budget must be >= 0 swaps under way, got {copy_budget}")
        self.copy_budget = copy_budget
        self.last_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)  # the last pass's routed pairs
        self.passes = 0

    def observe(self, counts_LE: torch.Tensor, num_tokens: int, is_prefill: bool) -> None:
        self.last_LE = counts_LE.detach().to("cpu", torch.float64)
        self.passes += 1
        self._update()

    def _update(self) -> None:
        raise NotImplementedError


class LRUPolicy(_Cache):
    name = "lru"

    def __init__(self, num_layers: int, num_experts: int, copy_budget: int = DEFAULT_COPY_BUDGET):
        super().__init__(num_layers, num_experts, copy_budget)
        self.last_use_LE = torch.full((num_layers, num_experts), -1.0, dtype=torch.float64)

    def _update(self) -> None:
        self.last_use_LE[self.last_LE > 0] = self.passes

    def propose(self, mask_LE: torch.Tensor, busy_LE: torch.Tensor) -> list[Swap]:
        used = self.last_LE > 0
        ins = torch.where(used & ~mask_LE & ~busy_LE, self.last_LE, NONE)
        age = self.passes - self.last_use_LE
        outs = torch.where(mask_LE & ~busy_LE & ~used, age, NONE)
        return pair_swaps(ins, outs, lambda i, o: o, room(self.copy_budget, busy_LE))


class LFUPolicy(_Cache):
    name = "lfu"

    def __init__(self, num_layers: int, num_experts: int, copy_budget: int = DEFAULT_COPY_BUDGET):
        super().__init__(num_layers, num_experts, copy_budget)
        self.frequency_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)

    def _update(self) -> None:
        self.frequency_LE += self.last_LE

    def propose(self, mask_LE: torch.Tensor, busy_LE: torch.Tensor) -> list[Swap]:
        ins = torch.where((self.last_LE > 0) & ~mask_LE & ~busy_LE, self.frequency_LE, NONE)
        outs = torch.where(mask_LE & ~busy_LE, -self.frequency_LE, NONE)  # least frequent first
        return pair_swaps(ins, outs, lambda i, o: i + o, room(self.copy_budget, busy_LE))
