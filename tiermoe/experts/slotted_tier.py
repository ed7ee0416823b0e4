"""The GPU tier of one layer as slots of the model's expert pool, computed with one grouped GEMM per projection and
no host sync.

Why: computing expert by expert needs the host to know which experts a batch routes to (`unique`, `.tolist()`,
one `where` per expert), and each of those waits for the device: 3 + g host synchronisations per layer per
decode step, during which the GPU idles. Here the layer's experts live in slots of the model's ExpertSlotPool
(tiermoe.experts.slot_pool), `slot_E` maps an expert id to its slot on the device, and a forward sorts the
(token, slot) pairs by slot and runs `torch._grouped_mm` over the layer's window of the pool (its lowest to its
highest slot; slots of other layers inside it are empty groups): every shape is fixed by T and K and by the
window the host already knows, so the host queues the whole layer without waiting, and a CUDA graph can
capture it.

The kernel over the window is chosen once per activation dtype by the device (tiermoe.experts.gpu_tier_kernel):
`torch._grouped_mm` where it runs on the device alone (bf16 on sm90/sm100), the Triton grouped GEMM elsewhere on
CUDA (tiermoe.experts.triton_grouped: the pairs' rows padded per slot, shapes fixed by T, K and W), and expert by
expert on the slot views only where neither applies (no CUDA, or no triton package): same results, with those
syncs. Legend: T tokens, D hidden, I expert width, K top-k, P = T * K pairs, W slots in the layer's window, R padded
rows.
"""

from __future__ import annotations

import torch

from tiermoe.experts import triton_grouped
from tiermoe.experts.ffn import ExpertActivation, routed_experts_forward
from tiermoe.experts.slot_pool import ExpertSlotPool, weight_fields
from tiermoe.experts.tiers import ExpertSet
from tiermoe.experts.weights import ExpertWeights


class SlottedExpertSet(ExpertSet):
    """The experts one GPU tier holds for one layer, in slots of `pool` (shared by the model's layers)."""

    def __init__(self, act: ExpertActivation, num_experts: int, pool: ExpertSlotPool):
        super().__init__(pool.device, act)
        self.pool = pool
        self.slot_E = torch.full((num_experts,), -1, dtype=torch.int64, device=self.device)  # -1: not here
        self._slot_of: dict[int, int] = {}  # expert -> slot, the host's copy of slot_E
        pool.join(self)

    def add(self, expert: int, weights: ExpertWeights) -> None:
        """Copy `weights` (on any device: a host copy goes straight into its slot) into a free slot of the pool."""
        if expert in self._slot_of:
            self.pop(expert)
        slot = self.pool.take(weights, self._window() if self._slot_of else None)
        views = self.pool.views(slot)
        for view, t in zip(views, weight_fields(weights)):
            if (view is None) != (t is None) or (view is not None and view.shape != t.shape):
                self.pool.give(slot)
                raise ValueError(f"expert {expert} does not have the layout of the pool's other experts")
            if view is not None:
                view.copy_(t)
        self._slot_of[expert] = slot
        self.slot_E[expert] = slot
        self.experts[expert] = self._held(views)

    def _held(self, views) -> ExpertWeights:
        """What `experts` holds for a slot: views of its stacked fields."""
        return ExpertWeights(*views)

    def pop(self, expert: int) -> ExpertWeights:
        """Give `expert`'s slot back to the pool; what it returns views that slot, valid until the pool reuses it."""
        self.pool.give(self._slot_of.pop(expert))
        self.slot_E[expert] = -1
        return self.experts.pop(expert)

    def make_room(self, experts: int) -> None:
        """Room for `experts` more before adding them (the pool grows once, not once per expert)."""
        self.pool.ensure_free(experts)

    def follow_pool(self) -> None:
        """The pool was reallocated: the views move to the new storage."""
        for expert, slot in self._slot_of.items():
            self.experts[expert] = self._held(self.pool.views(slot))

    @property
    def nbytes(self) -> int:
        """The bytes of the slots this layer holds (the pool's free slots: `pool.nbytes` counts them)."""
        return sum(w.nbytes for w in self.experts.values())

    def _window(self) -> tuple[int, int]:
        slots = self._slot_of.values()
        return min(slots), max(slots) + 1

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        if not self.experts:
            return torch.zeros_like(x_TD)
        kernel = self.pool.kernel(x_TD.dtype).name
        if kernel == "per_expert":
            return routed_experts_forward(self.experts, x_TD, ids_TK, weights_TK, self.act)
        lo, hi = self._window()
        width, k = hi - lo, ids_TK.shape[1]
        ids_P = ids_TK.reshape(-1)
        slot_P = self.slot_E[ids_P.clamp(min=0)]
        group_P = torch.where((ids_P >= 0) & (slot_P >= 0), slot_P - lo, width)  # not here: one group past W
        order_P = group_P.argsort(stable=True)  # pairs grouped by slot, each token's in router order
        group_sorted_P = group_P[order_P]
        token_P = order_P // k
        run = self._grouped_mm if kernel == "grouped_mm" else self._triton
        y_PD = run(x_TD, group_P, group_sorted_P, token_P, self.pool.window(lo, hi), width)
        y_PD = y_PD * weights_TK.reshape(-1)[order_P, None]
        y_PD = torch.where((group_sorted_P < width)[:, None], y_PD, 0)  # pairs of no slot here: dropped
        return torch.zeros_like(x_TD).index_add_(0, token_P, y_PD.to(x_TD.dtype))

    def _grouped_mm(self, x_TD, group_P, group_sorted_P, token_P, window, width) -> torch.Tensor:
        """[P, D] in sorted order by torch._grouped_mm (rows past the last group are not computed)."""
        gate_up_W2ID, down_WDI, gate_up_bias_W2I, down_bias_WD = window
        sizes_W = torch.zeros(width + 1, dtype=torch.int64, device=x_TD.device)
        sizes_W.index_add_(0, group_P, torch.ones_like(group_P))
        ends_W = sizes_W[:-1].cumsum(0).to(torch.int32)
        h_P2I = torch._grouped_mm(x_TD[token_P], gate_up_W2ID.transpose(1, 2), offs=ends_W)
        group_clamped_P = group_sorted_P.clamp(max=width - 1)
        if gate_up_bias_W2I is not None:
            h_P2I = h_P2I + gate_up_bias_W2I[group_clamped_P]
        y_PD = torch._grouped_mm(self.act(h_P2I), down_WDI.transpose(1, 2), offs=ends_W)
        if down_bias_WD is not None:
            y_PD = y_PD + down_bias_WD[group_clamped_P]
        return y_PD

    def _triton(self, x_TD, group_P, group_sorted_P, token_P, window, width) -> torch.Tensor:
        """[P, D] in sorted order by the Triton grouped GEMM over the padded rows."""
        gate_up_W2ID, down_WDI, gate_up_bias_W2I, down_bias_WD = window
        layout = triton_grouped.grouped_rows(group_sorted_P, token_P, width)
        slot_R = layout.block_slot_B.repeat_interleave(triton_grouped.BLOCK_M).clamp(min=0)
        h_R2I = triton_grouped.grouped_matmul(x_TD, layout, gate_up_W2ID)
        if gate_up_bias_W2I is not None:
            h_R2I = h_R2I + gate_up_bias_W2I[slot_R]
        # padding rows hold whatever the allocation held: they are never read back
        y_RD = triton_grouped.grouped_matmul(self.act(h_R2I), layout, down_WDI, rows_R=layout.own_rows())
        if down_bias_WD is not None:
            y_RD = y_RD + down_bias_WD[slot_R]
        return layout.pair_rows(y_RD)
