"""Dynamic placement while serving: a policy watches routing, copies run asynchronously, masks flip on landing.

The manager is a recorder (it sees every pass's routed ids) and, after every engine step, a scheduler of
copies: it finishes the copies that have landed (flipping the assignment of just those experts), queues the
policy's new swaps, and starts as many queued copies as the in-flight budget allows. A step never waits for a
copy, and every pass computes each expert from exactly one tier that holds it, so outputs stay exact.

The bookkeeping from proposal to landing is tiermoe.placement.swap_schedule's, the same object trace replay runs
(with copies timed by the cost model), so a replay of a recorded trace proposes the swaps serving did, step by step.
A swap runs in two copies, in this order, so it never needs more GPU memory than it frees:
1. demote `expert_out`: copy it to the CPU tier (none when the CPU tier kept its stored form, see
   tiermoe.experts.tiers: that copy has landed at once); once landed the CPU tier computes it and the GPU tier
   frees it;
2. promote `expert_in`: only then copy it to the GPU tier (its destination can take the block just freed);
   once landed the GPU tier computes it and the CPU tier releases it (an int4 tier keeps its stored form).
A cross-layer swap (Swap.layer_out set: a GPU slot moves from a cold layer to a hot one) runs the same way, the
demotion in `layer_out`, the promotion in `layer`, so the GPU tier never holds more experts than the budget.
Between the two both experts are computed on the CPU tier. A burst of swaps (kt-dynamic after a large prefill
proposes hundreds) is started a few copies at a time: at most `max_bytes_in_flight` of copies run at once
(default SWAP_EXPERTS_IN_FLIGHT experts' worth), which bounds the transients a copy holds (an FP8 GPU tier
dequantises each demoted expert on the GPU, the native CPU tier each promoted one on the host) and the host
buffers of demotions waiting for their promotion. Experts of a queued or running swap are busy: the policy is
told so, and a proposal that touches one is dropped. When the last swap of one proposal has landed (or been
dropped), one INFO line reports that update (tiermoe.engine.update_log).

With several ranks (hybrid.share set) the manager runs on rank 0 only (routing is the same on every rank, so
its counts are the global counts, counted once), and its swaps are not copied asynchronously: they are queued
on the share and applied synchronously by all ranks at the next step boundary (tiermoe.distributed.swaps).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from tiermoe.engine.update_log import log_update
from tiermoe.experts.copier import AsyncCopier
from tiermoe.placement.policies import Swap
from tiermoe.placement.swap_schedule import SWAP_EXPERTS_IN_FLIGHT, SwapSchedule
from tiermoe.stats.recording import PassInfo


@dataclass
class _Update:
    """The swaps of one proposal, followed until each has landed or been dropped."""

    pending: int
    started: float = field(default_factory=time.monotonic)
    layers: list[int] = field(default_factory=list)  # of the swaps done
    swaps: int = 0
    bytes: int = 0


class PlacementManager:
    enabled = True

    def __init__(self, hybrid, policy, copier: AsyncCopier | None = None, max_bytes_in_flight: int | None = None):
        self.hybrid = hybrid
        self.policy = policy
        self.copier = copier or AsyncCopier()
        spec = hybrid.spec
        # what one copy moves: the expert in the canonical layout and the model's dtype
        self.copy_bytes = spec.bytes_per_expert(hybrid.expert_dtype)
        self.max_bytes_in_flight = max_bytes_in_flight or SWAP_EXPERTS_IN_FLIGHT * self.copy_bytes
        # one copy always may run, whatever the budget, so an expert larger than it still moves
        self.schedule = SwapSchedule(max(1, self.max_bytes_in_flight // max(1, self.copy_bytes)))
        self.counts_LE = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.int64, device=hybrid.gpu_device)
        self._info: PassInfo | None = None
        self.swaps_started = 0
        self.copies_landed = 0
        self._updates: dict[Swap, _Update] = {}  # each queued or unfinished swap -> its proposal
        self.policy_name = getattr(policy, "name", type(policy).__name__)

    # the schedule's queues, as the tests and the distributed runner read them
    @property
    def queued(self):
        return self.schedule.queued

    @property
    def demoted(self):
        return self.schedule.demoted

    @property
    def in_flight(self):
        return self.schedule.in_flight

    # --- recorder side: counts of the current pass -----------------------------------------------------------
    def begin_pass(self, info: PassInfo) -> None:
        self._info = info
        self.counts_LE.zero_()

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        flat = ids_TK.reshape(-1)
        self.counts_LE[layer].index_add_(0, flat, torch.ones_like(flat))

    def end_pass(self) -> None:
        info = self._info
        self.policy.observe(self.counts_LE, info.total_tokens, any(info.is_prefill))

    # --- between steps: land copies, queue swaps, start copies within the budget -------------------------------
    def after_step(self) -> None:
        share = self.hybrid.share
        if share is not None:
            spec = self.hybrid.spec
            idle = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)  # nothing is ever in flight
            swaps = self.policy.propose(self.hybrid.mask, idle)
            share.queue_swaps(swaps)
            self.swaps_started += len(swaps)
            return
        self._land()
        busy = self.busy()
        accepted = self.schedule.accept(self.policy.propose(self.hybrid.mask, busy), busy)
        if accepted:
            update = _Update(pending=len(accepted))
            self._updates.update((swap, update) for swap in accepted)
        self._start_within_budget()

    def busy(self) -> torch.Tensor:
        """[L, E] bool: experts of a swap queued, half done or copying."""
        return self.schedule.busy(self.hybrid.spec.num_layers, self.hybrid.spec.num_experts)

    @property
    def bytes_in_flight(self) -> int:
        return len(self.in_flight) * self.copy_bytes

    def _in_place(self, swap: Swap) -> bool:
        gpu, cpu = self.hybrid.blocks[swap.out_layer].gpu_tier, self.hybrid.blocks[swap.layer].cpu_tier
        return swap.expert_out in gpu and swap.expert_in in cpu

    def _start_within_budget(self) -> None:
        start = lambda swap, layer, expert, to_gpu: self.hybrid.blocks[layer].start_move(expert, to_gpu, self.copier)
        started, dropped = self.schedule.start(self._in_place, start)
        self.swaps_started += len(started)
        for swap in dropped:
            self._finish(swap, done=False)

    def _land(self) -> None:
        """Finish the copies that have landed. Their tickets (which hold the source copies) are dropped when this
        returns, so a demoted expert's GPU memory is free before any promotion that follows allocates."""
        for c in self.schedule.landed():
            moved = self.hybrid.blocks[c.layer].finish_move(c.expert, c.to_gpu, c.ticket.result())
            self.hybrid.swap_stats.swaps += 1
            self.hybrid.swap_stats.bytes += moved
            self.copies_landed += 1
            self._updates[c.swap].bytes += moved
            if self.schedule.after_landing(c):
                self._finish(c.swap, done=True)

    def _finish(self, swap: Swap, done: bool) -> None:
        """A swap is over (done, or dropped); the last one of its proposal logs the update."""
        update = self._updates.pop(swap)
        update.pending -= 1
        if done:
            update.swaps += 1
            update.layers.append(swap.layer)
        if update.pending == 0 and update.swaps:
            log_update(self.policy_name, update.layers, update.swaps, update.bytes, time.monotonic() - update.started)

    def drain(self) -> None:
        """Run every queued swap to the end, waiting for each copy (shutdown, tests)."""
        self._start_within_budget()
        while self.in_flight:
            for c in self.in_flight:
                c.ticket.result()
            self._land()
            self._start_within_budget()

    def close(self) -> None:
        self.drain()
        self.copier.close()


def warn_if_never_fires(dynamic_update: bool, threshold: int | None) -> None:
    if dynamic_update and not threshold:
        warnings.warn("--kt-enable-dynamic-expert-update without --kt-gpu-prefill-token-threshold never fires "
                      "(the update follows layerwise GPU prefill batches); set a threshold", stacklevel=2)
