"""Dynamic placement while serving: a policy watches routing, copies run asynchronously, masks flip on landing.

The manager is a recorder (it sees every pass's routed ids) and, after every engine step, a scheduler of
copies: it finishes the copies that have landed (flipping the mask of just those experts), then asks the policy
for new swaps and starts their copies. A step never waits for a copy. During a swap both copies exist for a
while: the promoted expert serves from the GPU tier once its copy lands, the demoted one keeps serving from the
GPU tier until its host copy lands; so every pass computes each expert from exactly one tier and stays exact.

With several ranks (hybrid.share set) the manager runs on rank 0 only (routing is the same on every rank, so
its counts are the global counts, counted once), and its swaps are not copied asynchronously: they are queued
on the share and applied synchronously by all ranks at the next step boundary (tiermoe.distributed.swaps).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from tiermoe.experts.copier import AsyncCopier, CopyTicket
from tiermoe.placement.policies import Swap
from tiermoe.stats.recording import PassInfo


@dataclass
class _InFlight:
    layer: int
    expert: int
    to_gpu: bool
    ticket: CopyTicket


class PlacementManager:
    enabled = True

    def __init__(self, hybrid, policy, copier: AsyncCopier | None = None):
        self.hybrid = hybrid
        self.policy = policy
        self.copier = copier or AsyncCopier()
        spec = hybrid.spec
        self.counts_LE = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.int64, device=hybrid.gpu_device)
        self._info: PassInfo | None = None
        self.in_flight: list[_InFlight] = []
        self.swaps_started = 0
        self.copies_landed = 0

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

    # --- between steps: land copies, start new ones ----------------------------------------------------------
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
        busy = torch.zeros(self.hybrid.spec.num_layers, self.hybrid.spec.num_experts, dtype=torch.bool)
        for c in self.in_flight:
            busy[c.layer, c.expert] = True
        for swap in self.policy.propose(self.hybrid.mask, busy):
            self._start(swap)

    def _start(self, swap: Swap) -> None:
        block = self.hybrid.blocks[swap.layer]
        self.in_flight.append(_InFlight(swap.layer, swap.expert_in, True,
                                        block.start_move(swap.expert_in, True, self.copier)))
        self.in_flight.append(_InFlight(swap.layer, swap.expert_out, False,
                                        block.start_move(swap.expert_out, False, self.copier)))
        self.swaps_started += 1

    def _land(self) -> None:
        still = []
        for c in self.in_flight:
            if c.ticket.landed():
                moved = self.hybrid.blocks[c.layer].finish_move(c.expert, c.to_gpu, c.ticket.result())
                self.hybrid.swap_stats.swaps += 1
                self.hybrid.swap_stats.bytes += moved
                self.copies_landed += 1
            else:
                still.append(c)
        self.in_flight = still

    def drain(self) -> None:
        """Wait for every copy in flight and land it (shutdown, tests)."""
        for c in self.in_flight:
            c.ticket.result()
        self._land()

    def close(self) -> None:
        self.drain()
        self.copier.close()


def warn_if_never_fires(dynamic_update: bool, threshold: int | None) -> None:
    if dynamic_update and not threshold:
        warnings.warn("--kt-enable-dynamic-expert-update without --kt-gpu-prefill-token-threshold never fires "
                      "(the update follows layerwise GPU prefill batches); set a threshold", stacklevel=2)
