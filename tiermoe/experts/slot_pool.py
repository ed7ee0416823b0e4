"""Every GPU-tier expert of a model on one device, in slots of stacked tensors that all its layers share.

Why one pool for the model rather than a stack per layer: a swap that moves a GPU slot from a cold layer to a
hot one (adaptive placement's cross-layer swaps) then hands the slot over as it is, with no memory moved or
added. Per-layer stacks would have to grow the hot layer's stack (a transient copy of all its GPU experts: gigabytes
on DeepSeek-V3) while the cold layer kept its freed slot.

The pool is sized once at load for the experts the placement puts on this device (`reserve`); a demotion frees
a slot (its memory stays in the pool, for the next promotion), a promotion takes the free slot nearest its
layer's others (so a layer's slots stay a short window of the pool; see SlottedExpertSet). Only a placement
that puts more experts on the GPU than the pool was sized for grows it, by copying it. `nbytes` is the whole
pool, what the device really holds. Legend: S slots.
"""

from __future__ import annotations

import torch

from tiermoe.experts.weights import ExpertWeights

Fields = list[torch.Tensor | None]  # gate_up, down, gate_up_bias, down_bias (None: the model has no such tensor)


def weight_fields(w: ExpertWeights) -> Fields:
    return [w.gate_up, w.down, w.gate_up_bias, w.down_bias]


class ExpertSlotPool:
    """Stacked expert slots on `device`: stacks[f] is [S, ...] for each ExpertWeights field f."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.stacks: Fields | None = None
        self._free: list[int] = []  # ascending
        self._reserved = 0
        self._users: list = []  # the tiers whose views must follow when the pool grows
        self._grouped: dict[torch.dtype, bool] = {}  # dtype -> whether torch._grouped_mm takes these stacks

    @property
    def capacity(self) -> int:
        return 0 if self.stacks is None else self.stacks[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.stacks or () if s is not None)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def reserve(self, slots: int) -> None:
        """Size the pool for `slots` more experts, allocated when the first one is added (once)."""
        self._reserved += slots

    def join(self, tier) -> None:
        """`tier` holds views of slots: `tier.follow_pool()` is called after the pool is reallocated."""
        self._users.append(tier)

    def ensure_free(self, slots: int) -> None:
        """At least `slots` free slots, growing the pool once (not once per expert) when it has fewer."""
        if self.stacks is None:
            self._reserved = max(self._reserved, slots)
        elif len(self._free) < slots:
            self._grow(self.capacity + slots - len(self._free))

    def take(self, like: ExpertWeights, near: tuple[int, int] | None) -> int:
        """A free slot for an expert shaped `like`: the one nearest the window [lo, hi) when given."""
        if self.stacks is None:
            self._allocate(like, max(self._reserved, 1))
        if not self._free:
            self._grow(self.capacity + 1)
        if near is None:
            slot = self._free[0]
        else:
            lo, hi = near
            slot = min(self._free, key=lambda s: (lo - s if s < lo else s - hi + 1, s))
        self._free.remove(slot)
        return slot

    def give(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort()

    def views(self, slot: int) -> Fields:
        return [None if s is None else s[slot] for s in self.stacks]

    def window(self, lo: int, hi: int) -> Fields:
        """The stacks' slots [lo, hi), as views (contiguous: what a grouped GEMM takes)."""
        return [None if s is None else s[lo:hi] for s in self.stacks]

    def grouped_mm_runs(self, dtype: torch.dtype) -> bool:
        """Whether torch._grouped_mm takes these stacks for activations of `dtype` (probed once per dtype)."""
        if dtype not in self._grouped:
            self._grouped[dtype] = _probe_grouped_mm(self.stacks, dtype)
        return self._grouped[dtype]

    def _allocate(self, like: ExpertWeights, slots: int) -> None:
        self.stacks = [None if t is None else torch.empty((slots, *t.shape), dtype=t.dtype, device=self.device)
                       for t in weight_fields(like)]
        self._free = list(range(slots))

    def _grow(self, slots: int) -> None:
        old = self.capacity
        self.stacks = [None if s is None else torch.cat([s, s.new_empty((slots - old, *s.shape[1:]))])
                       for s in self.stacks]
        self._free += list(range(old, slots))
        for tier in self._users:
            tier.follow_pool()


def _probe_grouped_mm(stacks: Fields, dtype: torch.dtype) -> bool:
    """One tiny grouped GEMM per projection on the real stacks: the dtype must match the stacks' (as F.linear
    would demand), and the device must take the dtype and the rows' alignment."""
    gate_up, down = stacks[0], stacks[1]
    if getattr(torch, "_grouped_mm", None) is None or gate_up.dtype != dtype or down.dtype != dtype:
        return False
    offs = torch.ones(1, dtype=torch.int32, device=gate_up.device)
    try:
        torch._grouped_mm(gate_up.new_zeros(1, gate_up.shape[2]), gate_up[:1].transpose(1, 2), offs=offs)
        torch._grouped_mm(down.new_zeros(1, down.shape[2]), down[:1].transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True
