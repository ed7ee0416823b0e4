"""Swaps from proposal to landing: the one schedule the live engine (tiermoe.engine.placement_manager, real copies)
and trace replay (tiermoe.analysis.trace_replay and placement_traffic, copies timed by the cost model) both run, so
a policy sees the same placement and the same busy experts after every step in both, and proposes the same swaps.

After every step (a pass), in this order:
1. land: the copies that have landed are finished by the caller (the mask entry of just that expert flips); a
   demotion that landed leaves its swap waiting for its promotion;
2. the policy proposes, told which experts are busy (of a swap queued, half done or copying); a proposal that
   touches a busy expert is dropped, the rest are queued;
3. start copies while there is room (`max_in_flight` copies at once; one always may run): promotions of swaps whose
   demotion landed first (each finishes a swap whose GPU memory is already free), then the demotions of queued
   swaps, each only if its experts are still where the swap expects them (else it is dropped: the placement moved
   on since).
A swap thus never needs more GPU memory than it frees; between its two copies both experts are on the CPU tier.
Legend: L layers, E experts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiermoe.placement.policies import Swap

# Copies at once, in experts, in the live engine: one copy of one expert already runs PCIe at its full rate (a
# Qwen3-30B expert, 9 MiB, takes about 0.4 ms at 25 GB/s, far less than a decode step), so more at once would not
# swap faster, only hold more transients. Four keep a demotion and a promotion of two swaps overlapping; their
# transients (at most four experts: 336 MiB at DeepSeek-V3's 84 MiB bf16 experts) stay below the 512 MiB floor of
# the `auto` margin. The adaptive policy keeps at most max_swaps_in_flight (4) swaps busy, one copy each at a time,
# so this never holds its copies back.
SWAP_EXPERTS_IN_FLIGHT = 4


@dataclass
class Copy:
    """One copy under way: `swap`'s demotion (to_gpu False, in swap.out_layer) or promotion. `ticket` is the
    caller's handle (anything with landed())."""

    swap: Swap
    layer: int
    expert: int
    to_gpu: bool
    ticket: object


class SwapSchedule:
    def __init__(self, max_in_flight: int | None = SWAP_EXPERTS_IN_FLIGHT):
        self.max_in_flight = max_in_flight  # copies at once (None: no limit)
        self.queued: deque[Swap] = deque()  # proposed, nothing copied yet
        self.demoted: deque[Swap] = deque()  # expert_out landed on the CPU tier; expert_in waits to be promoted
        self.in_flight: list[Copy] = []

    def busy(self, num_layers: int, num_experts: int) -> torch.Tensor:
        """[L, E] bool: experts of a swap queued, half done or copying."""
        busy = torch.zeros(num_layers, num_experts, dtype=torch.bool)
        for s in (*self.queued, *self.demoted, *(c.swap for c in self.in_flight)):
            busy[s.layer, s.expert_in] = busy[s.out_layer, s.expert_out] = True
        return busy

    def accept(self, proposals: list[Swap], busy_LE: torch.Tensor) -> list[Swap]:
        """Queue the proposals that touch no busy expert (each marks its two busy for the next); returns them."""
        accepted = []
        for swap in proposals:
            if not (busy_LE[swap.layer, swap.expert_in] or busy_LE[swap.out_layer, swap.expert_out]):
                busy_LE[swap.layer, swap.expert_in] = busy_LE[swap.out_layer, swap.expert_out] = True
                accepted.append(swap)
        self.queued.extend(accepted)
        return accepted

    def landed(self) -> list[Copy]:
        """Take the copies that have landed out of flight, in the order they were started. The caller finishes each
        (flips its expert) and then calls `after_landing` with it."""
        done = [c for c in self.in_flight if c.ticket.landed()]
        self.in_flight = [c for c in self.in_flight if c not in done]
        return done

    def after_landing(self, copy: Copy) -> bool:
        """A finished copy: a demotion's swap now waits for its promotion; True when the swap is done."""
        if not copy.to_gpu:
            self.demoted.append(copy.swap)
            return False
        return True

    def _room(self) -> bool:
        return self.max_in_flight is None or not self.in_flight or len(self.in_flight) < self.max_in_flight

    def start(self, in_place: Callable[[Swap], bool], start_copy: Callable[[Swap, int, int, bool], object]
              ) -> tuple[list[Swap], list[Swap]]:
        """Start copies within the room: promotions first, then demotions of queued swaps whose experts are still
        where they were (`in_place(swap)`: expert_out on the GPU tier of out_layer, expert_in on the CPU tier of
        layer). start_copy(swap, layer, expert, to_gpu) starts one copy and returns its ticket. Returns (swaps whose
        demotion started, swaps dropped)."""
        started, dropped = [], []
        while self.demoted and self._room():
            swap = self.demoted.popleft()
            self.in_flight.append(Copy(swap, swap.layer, swap.expert_in, True,
                                       start_copy(swap, swap.layer, swap.expert_in, True)))
        while self.queued and self._room():
            swap = self.queued.popleft()
            if not in_place(swap):
                dropped.append(swap)
                continue
            self.in_flight.append(Copy(swap, swap.out_layer, swap.expert_out, False,
                                       start_copy(swap, swap.out_layer, swap.expert_out, False)))
            started.append(swap)
        return started, dropped

    @property
    def idle(self) -> bool:
        return not (self.queued or self.demoted or self.in_flight)
