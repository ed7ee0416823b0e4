"""The GPU tier of one layer as stacked expert slots, computed with one grouped GEMM per projection and no sync.

Why: computing expert by expert needs the host to know which experts a batch routes to (`unique`, `.tolist()`,
one `where` per expert), and each of those waits for the device: 3 + g host synchronisations per layer per
decode step, during which the GPU idles. Here the tier's experts live in slots of one stacked tensor per
projection, `slot_E` maps an expert id to its slot on the device, and a forward sorts the (token, slot) pairs by
slot and runs `torch._grouped_mm` over the groups: every shape is fixed by T and K, so the host queues the whole
layer without waiting, and a CUDA graph can capture it.

Where `torch._grouped_mm` does not take the tier's device, dtype or shapes (it needs 16-byte aligned rows;
which dtypes a device takes is probed once per tier), the forward computes expert by expert on the slot views
instead, as every tier did before: same results, with those syncs.

Slots: `reserve(n)` (the loader, from the placement) sizes the stacks once; a tier swap reuses a freed slot; an
add beyond the capacity (a layer that gains experts) grows the stacks by copying them. `nbytes` is the
capacity, what the device really holds. Legend: T tokens, D hidden, I expert width, K top-k, P = T * K pairs,
S slots.
"""

from __future__ import annotations

import torch

from tiermoe.experts.ffn import ExpertActivation, routed_experts_forward
from tiermoe.experts.tiers import ExpertSet
from tiermoe.experts.weights import ExpertWeights


class SlottedExpertSet(ExpertSet):
    """The experts one GPU tier holds for one layer, in slots of stacked tensors on `device`."""

    def __init__(self, device: torch.device | str, act: ExpertActivation, num_experts: int):
        super().__init__(device, act)
        self.slot_E = torch.full((num_experts,), -1, dtype=torch.int64, device=self.device)  # -1: not here
        self._stacks: list[torch.Tensor | None] | None = None  # per ExpertWeights field: [S, ...] (None: absent)
        self._slot_of: dict[int, int] = {}  # expert -> slot, the host's copy of slot_E
        self._free: list[int] = []
        self._capacity = 0
        self._reserved = 0
        self._grouped: dict[torch.dtype, bool] = {}  # dtype -> whether torch._grouped_mm runs here

    # -- holding
    def reserve(self, slots: int) -> None:
        """Size the stacks for `slots` experts when the first one is added (one allocation per projection)."""
        self._reserved = max(self._reserved, slots)

    def add(self, expert: int, weights: ExpertWeights) -> None:
        """Copy `weights` (on any device: a host copy goes straight into its slot) into a free slot."""
        if expert in self._slot_of:
            self.pop(expert)
        if self._stacks is None:
            self._allocate(weights, max(self._reserved, 1))
        if not self._free:
            self._grow(self._capacity + 1)
        slot = self._free.pop(0)
        views = self._views(slot)
        for view, t in zip(views, _fields(weights)):
            if (view is None) != (t is None):
                raise ValueError(f"expert {expert} does not have the layout of this tier's other experts")
            if view is not None:
                view.copy_(t)
        self._slot_of[expert] = slot
        self.slot_E[expert] = slot
        self.experts[expert] = ExpertWeights(*views)

    def pop(self, expert: int) -> ExpertWeights:
        """Release `expert`'s slot; what it returns views that slot, valid until the next `add` reuses it."""
        slot = self._slot_of.pop(expert)
        self.slot_E[expert] = -1
        self._free.append(slot)
        self._free.sort()
        return self.experts.pop(expert)

    def trim(self) -> int:
        """Give the free slots' memory back (the stacks are copied into exactly the held slots); returns bytes
        released. Swaps leave a freed slot for the next expert in, so only a layer that keeps fewer experts
        for good (`HybridMoE.move_experts` after demotions) calls this."""
        if not self._free or self._stacks is None:
            return 0
        before = self.nbytes
        experts = sorted(self._slot_of, key=self._slot_of.get)
        if not experts:
            self._stacks, self._capacity, self._free = None, 0, []
        else:
            keep = torch.tensor([self._slot_of[e] for e in experts], device=self.device)
            self._stacks = [None if s is None else s.index_select(0, keep) for s in self._stacks]
            self._capacity, self._free = len(experts), []
            for slot, expert in enumerate(experts):
                self._slot_of[expert] = slot
                self.slot_E[expert] = slot
                self.experts[expert] = ExpertWeights(*self._views(slot))
        self._reserved = len(experts)
        return before - self.nbytes

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._stacks or () if s is not None)

    def _allocate(self, like: ExpertWeights, slots: int) -> None:
        self._stacks = [None if t is None else torch.empty((slots, *t.shape), dtype=t.dtype, device=self.device)
                        for t in _fields(like)]
        self._capacity, self._free = slots, list(range(slots))

    def _grow(self, slots: int) -> None:
        old = self._stacks
        self._stacks = [None if s is None else torch.cat([s, s.new_empty((slots - s.shape[0], *s.shape[1:]))])
                        for s in old]
        self._free += list(range(self._capacity, slots))
        self._capacity = slots
        for expert, slot in self._slot_of.items():  # the views must follow the new storage
            self.experts[expert] = ExpertWeights(*self._views(slot))

    def _views(self, slot: int) -> list[torch.Tensor | None]:
        return [None if s is None else s[slot] for s in self._stacks]

    # -- computing
    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        if not self.experts:
            return torch.zeros_like(x_TD)
        if not self._grouped_mm_runs(x_TD.dtype):
            return routed_experts_forward(self.experts, x_TD, ids_TK, weights_TK, self.act)
        gate_up_S2ID, down_SDI, gate_up_bias_S2I, down_bias_SD = self._stacks
        t, k = ids_TK.shape
        ids_P = ids_TK.reshape(-1)
        held_P = ids_P >= 0
        slot_P = torch.where(held_P, self.slot_E[ids_P.clamp(min=0)], self._capacity)  # not here: one group past S
        slot_P = torch.where(slot_P < 0, self._capacity, slot_P)
        order_P = slot_P.argsort(stable=True)  # pairs grouped by slot, each token's in router order
        slot_sorted_P = slot_P[order_P]
        token_P = order_P // k
        ones = torch.ones_like(slot_P)
        ends_S = torch.zeros(self._capacity + 1, dtype=torch.int64, device=x_TD.device).index_add_(0, slot_P, ones)
        ends_S = ends_S[:-1].cumsum(0).to(torch.int32)
        h_P2I = torch._grouped_mm(x_TD[token_P], gate_up_S2ID.transpose(1, 2), offs=ends_S)
        in_group_P = slot_sorted_P < self._capacity
        slot_clamped_P = slot_sorted_P.clamp(max=self._capacity - 1)
        if gate_up_bias_S2I is not None:
            h_P2I = h_P2I + gate_up_bias_S2I[slot_clamped_P]
        y_PD = torch._grouped_mm(self.act(h_P2I), down_SDI.transpose(1, 2), offs=ends_S)
        if down_bias_SD is not None:
            y_PD = y_PD + down_bias_SD[slot_clamped_P]
        y_PD = y_PD * weights_TK.reshape(-1)[order_P, None]
        y_PD = torch.where(in_group_P[:, None], y_PD, 0)  # rows past the last group are not computed: drop them
        return torch.zeros_like(x_TD).index_add_(0, token_P, y_PD.to(x_TD.dtype))

    def _grouped_mm_runs(self, dtype: torch.dtype) -> bool:
        """Whether torch._grouped_mm takes this tier's stacks for activations of `dtype` (probed once)."""
        if dtype not in self._grouped:
            self._grouped[dtype] = _probe_grouped_mm(self._stacks, dtype)
        return self._grouped[dtype]


def _fields(w: ExpertWeights) -> list[torch.Tensor | None]:
    return [w.gate_up, w.down, w.gate_up_bias, w.down_bias]


def _probe_grouped_mm(stacks: list[torch.Tensor | None], dtype: torch.dtype) -> bool:
    """One tiny grouped GEMM per projection on the real stacks: the dtype must match the stacks' (as F.linear
    would demand), and the device must take the dtype and the rows' alignment."""
    gate_up, down = stacks[0], stacks[1]
    if getattr(torch, "_grouped_mm", None) is None or gate_up.dtype != dtype or down.dtype != dtype:
        return False
    offs = torch.ones(gate_up.shape[0], dtype=torch.int32, device=gate_up.device).cumsum(0).to(torch.int32)
    try:
        rows = gate_up.shape[0]
        torch._grouped_mm(gate_up.new_zeros(rows, gate_up.shape[2]), gate_up.transpose(1, 2), offs=offs)
        torch._grouped_mm(down.new_zeros(rows, down.shape[2]), down.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True
