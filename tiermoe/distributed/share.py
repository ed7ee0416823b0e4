"""One rank's share of a multi-rank model: which experts it holds, where the CPU tier lives, how outputs meet.

The plan's assignment [L, E] (-1 = CPU tier, r >= 0 = GPU rank r) is the same on every rank. Rank r's GPU tier
holds exactly the experts assigned to r, rank 0 alone holds and computes the CPU
tier, and every MoE layer sums the ranks' partial outputs with one all-reduce. The loader and the HybridMoE blocks
see this object through the loader's RankShare protocol; the leader (rank 0) and the swap queue ride along.

Rank 0 reads each CPU expert straight into its slot of a SharedExpertStore and hands the slot's tensors to the CPU
tier. A backend that computes from the tensors it is given (the torch backend, and the native one for experts it
keeps in the checkpoint's layout) then holds the expert in shared memory, where the ranks of the host can map it.
A backend that converts experts into its own format on `add` (the native backend's packed bf16 / int8 / int4 / int6)
holds its own copy: the slot is released at once, so the host still holds one copy, in rank 0's memory, and
swaps pass experts through the slots (`kept(layer)` says which case a layer is in).
"""

from __future__ import annotations

import torch

from tiermoe.distributed.group import RankGroup
from tiermoe.distributed.shm_store import SharedExpertStore
from tiermoe.experts.weights import ExpertWeights
from tiermoe.placement.policies import Swap


class ExpertShare:
    def __init__(self, group: RankGroup, store: SharedExpertStore | None, hosts: list[int]):
        self.group = group
        self.rank = group.rank
        self.num_ranks = group.world_size
        self.holds_cpu_tier = group.rank == 0  # exactly one process computes the CPU experts
        self.store = store  # rank 0: the creator; ranks of its host: attached; None on other hosts
        self.hosts = hosts  # node (host) of every rank, by rank
        self.leader = None  # rank 0: publishes every step (set by RankModel)
        self._queued: list[Swap] = []
        self._kept: dict[int, bool] = {}  # rank 0: layer -> its CPU tier computes from the slots' tensors

    def same_host(self, rank: int) -> bool:
        """Whether `rank` runs on rank 0's host, so it can map the shared store."""
        return self.hosts[rank] == self.hosts[0]

    @property
    def store_on_this_host(self) -> bool:
        return self.same_host(self.rank)

    # --- what the loader and the blocks call -----------------------------------------------------------
    def reduce(self, y_TD: torch.Tensor) -> torch.Tensor:
        """[T, D] partial routed output of this rank -> the sum over all ranks (the same on every rank)."""
        return self.group.all_reduce_sum(y_TD)

    def cpu_slot(self, layer: int, expert: int) -> ExpertWeights:
        """Where the loader reads a CPU-tier expert: its slot in the shared store (views of shared memory)."""
        return self.store.slot(layer, expert, lock=False)  # locked once a swap copies it to a GPU

    def cpu_added(self, layer: int, expert: int, tier) -> None:
        """The CPU tier took `expert` from its slot: keep the slot if the tier computes from it, else release it."""
        if layer not in self._kept:  # the same backend decides the same way for every expert of a layer
            slot = {t.data_ptr() for t in self.store.slot(layer, expert, lock=False).tensors()}
            self._kept[layer] = all(t.data_ptr() in slot for t in tier.get(expert).tensors())
        if not self._kept[layer]:
            self.store.release(layer, expert)

    def kept(self, layer: int) -> bool:
        """Rank 0: whether `layer`'s CPU tier holds its experts in their shared-memory slots."""
        return self._kept.get(layer, True)

    # --- dynamic placement: rank 0 queues, every rank applies at the next step boundary ----------------
    def queue_swaps(self, swaps: list[Swap]) -> None:
        self._queued.extend(swaps)

    def take_swaps(self) -> list[Swap]:
        swaps, self._queued = self._queued, []
        return swaps

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
