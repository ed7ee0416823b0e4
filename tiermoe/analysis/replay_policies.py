"""The dynamic policies trace replay runs, built for one trace: KT's dynamic update and tiermoe's adaptive policy
(tiermoe.placement.policies), the LRU and LFU expert caches (tiermoe.placement.cache_policies), and Belady's
policy, which knows the trace's future and so only replay can run it: the ceiling of a cache with the same copy
budget.

Belady with a copy budget: after each pass, promote the CPU-tier experts whose next use comes soonest in place of
the GPU-tier ones whose next use comes last (never-used-again first), while the promoted one is needed before the
evicted one, at most `copy_budget` swaps under way (as the caches). Unlike the caches it prefetches (an expert need
not have missed).
Greedy: with a budget and copies that take time it is the classic ceiling, not a proven bound (on a sharp
workload shift LRU can come within a point of it, or above by a fraction of one).
Legend: P passes, M MoE layers, E experts.
"""

from __future__ import annotations

import torch

from tiermoe.placement.adaptive_policy import AdaptivePolicy, AdaptiveSettings
from tiermoe.placement.cache_policies import (
    DEFAULT_COPY_BUDGET,
    NONE,
    LFUPolicy,
    LRUPolicy,
    pair_swaps,
    room,
)
from tiermoe.placement.pass_cost import PassCostModel
from tiermoe.placement.policies import KTDynamicPolicy, Swap

CACHES = ("lru", "lfu")


def next_use_PME(counts_PME: torch.Tensor) -> torch.Tensor:
    """float32 [P, M, E]: the first pass after p that routes to (m, e); P + 1e6 when none does."""
    num_p = counts_PME.shape[0]
    never = float(num_p + 1_000_000)
    out = torch.empty(counts_PME.shape, dtype=torch.float32)
    following = torch.full(counts_PME.shape[1:], never)
    for p in range(num_p - 1, -1, -1):
        out[p] = following
        following = torch.where(counts_PME[p] > 0, torch.tensor(float(p)), following)
    return out


class BeladyPolicy:
    name = "belady"

    def __init__(self, counts_PME: torch.Tensor, copy_budget: int = DEFAULT_COPY_BUDGET):
        self.next_PME = next_use_PME(counts_PME)
        self.copy_budget = copy_budget
        self.passes = 0

    def observe(self, counts_LE: torch.Tensor, num_tokens: int, is_prefill: bool) -> None:
        self.passes += 1

    def propose(self, mask_LE: torch.Tensor, busy_LE: torch.Tensor) -> list[Swap]:
        upcoming = self.next_PME[self.passes - 1].double()  # after the pass just observed
        ins = torch.where(~mask_LE & ~busy_LE & (upcoming < self.next_PME.shape[0]), -upcoming, NONE)
        outs = torch.where(mask_LE & ~busy_LE, upcoming, NONE)
        return pair_swaps(ins, outs, lambda i, o: o + i, room(self.copy_budget, busy_LE))  # needed before evicted


def make_policy(policy: str, counts_PME: torch.Tensor, cost: PassCostModel, prior_ME: torch.Tensor | None,
                prefill_threshold: int | None, adaptive: AdaptiveSettings | None, copy_budget: int):
    m, e = counts_PME.shape[1], counts_PME.shape[2]
    if policy == "kt-dynamic":
        return KTDynamicPolicy(prefill_threshold)
    if policy == "lru":
        return LRUPolicy(m, e, copy_budget)
    if policy == "lfu":
        return LFUPolicy(m, e, copy_budget)
    if policy == "belady":
        return BeladyPolicy(counts_PME, copy_budget)
    # the same copy budget as the caches unless settings say otherwise
    return AdaptivePolicy(m, e, cost, adaptive or AdaptiveSettings(max_swaps_in_flight=copy_budget), prior_ME)
