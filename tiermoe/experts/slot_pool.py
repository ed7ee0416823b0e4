"""Every GPU-tier expert of a model on one device, in slots of stacked tensors that all its layers share.

Why one pool for the model rather than a stack per layer: a swap that moves a GPU slot from a cold layer to a
hot one (adaptive placement's cross-layer swaps) then hands the slot over as it is, with no memory moved or
added. Per-layer stacks would have to grow the hot layer's stack (a transient copy of all its GPU experts: gigabytes
on DeepSeek-V3) while the cold layer kept its freed slot.

The pool is sized once at load for the experts the placement puts on this device (`reserve`); a demotion frees
a slot (its memory stays in the pool, for the next promotion), a promotion takes the free slot nearest its
layer's others (so a layer's slots stay a short window of the pool; see SlottedExpertSet). Only a placement
that puts more experts on the GPU than the pool was sized for grows it, by copying it. `nbytes` is the whole
pool, what the device really holds. Which kernel computes over the slots is chosen once per activation dtype
(tiermoe.experts.gpu_tier_kernel). Legend: S slots.
"""

from __future__ import annotations

import torch

from tiermoe.experts import triton_grouped
from tiermoe.experts.fp8_blocks import FP8_DTYPES
from tiermoe.experts.gpu_tier_kernel import (
    KernelChoice,
    choose_kernel,
    device_capability,
)
from tiermoe.experts.weights import ExpertWeights

# gate_up, down, gate_up_bias, down_bias (None: the model has no such tensor); or an FP8 expert's codes and scales
Fields = list[torch.Tensor | None]


def weight_fields(w) -> Fields:
    """The tensors a slot stacks: ExpertWeights' four, or FP8ExpertWeights' (tiermoe.experts.fp8_tier) codes and
    scales of gate, up and down."""
    if isinstance(w, ExpertWeights):
        return [w.gate_up, w.down, w.gate_up_bias, w.down_bias]
    return w.tensors()


class ExpertSlotPool:
    """Stacked expert slots on `device`: stacks[f] is [S, ...] for each ExpertWeights field f. `kernel` forces
    the GPU tier's kernel ("grouped_mm", "triton", "per_expert"; tests run the Triton one on the CPU under
    Triton's interpreter), None chooses it by the device."""

    def __init__(self, device: torch.device | str, kernel: str | None = None):
        self.device = torch.device(device)
        self.stacks: Fields | None = None
        self._free: list[int] = []  # ascending
        self._reserved = 0
        self._users: list = []  # the tiers whose views must follow when the pool grows
        self._forced = kernel
        self._kernels: dict[torch.dtype, KernelChoice] = {}  # activation dtype -> the kernel chosen for it

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

    def kernel(self, dtype: torch.dtype) -> KernelChoice:
        """The kernel for activations of `dtype` (chosen once per dtype). One whose weights are not of the
        activations' dtype computes expert by expert (where F.linear refuses the mix, as it should)."""
        if dtype not in self._kernels:
            self._kernels[dtype] = self._choose(dtype)
        return self._kernels[dtype]

    def _choose(self, dtype: torch.dtype) -> KernelChoice:
        first = self.stacks[0]
        fp8 = first.dtype in FP8_DTYPES  # codes, decoded to the activations' dtype by the kernel
        if first.dtype != dtype and not fp8:
            return KernelChoice("per_expert", f"{first.dtype} weights, {dtype} activations")
        if self._forced is not None:
            return KernelChoice(self._forced, "forced")
        capability = device_capability(self.device)
        probed = capability is None and not fp8 and _probe_grouped_mm(self.stacks, dtype)
        return choose_kernel(capability, dtype, fp8, triton_available=triton_grouped.available(),
                             grouped_mm_runs=probed)

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


def fp8_kernel(device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """The kernel a pool of FP8 codes on `device` would run for activations of `dtype` (before it holds any)."""
    return choose_kernel(device_capability(device), dtype, fp8=True, triton_available=triton_grouped.available())


def _probe_grouped_mm(stacks: Fields, dtype: torch.dtype) -> bool:
    """One tiny grouped GEMM per projection on the real stacks: the dtype must match the stacks' (as F.linear
    would demand), and the device must take the dtype and the rows' alignment."""
    gate_up, down = stacks[0], stacks[1]
    if getattr(torch, "_grouped_mm", None) is None or down.dtype != dtype:
        return False
    offs = torch.ones(1, dtype=torch.int32, device=gate_up.device)
    try:
        torch._grouped_mm(gate_up.new_zeros(1, gate_up.shape[2]), gate_up[:1].transpose(1, 2), offs=offs)
        torch._grouped_mm(down.new_zeros(1, down.shape[2]), down[:1].transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True
