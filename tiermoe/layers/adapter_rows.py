"""Which LoRA adapter each row of a step runs with: what every per-row adapter module of one model reads.

Adapters served per request (tiermoe.model.served_adapters) each hold a slot, 1 ... max; slot 0 is the base model.
The engine tells the model, before each forward, the slot of every row of the step (`begin`), and clears it after
(`end`). An adapted weight keeps the factors of every slot that adapts it side by side (tiermoe.layers.lora_stack:
A [R, in], B [out, R], R the ranks of those slots summed), and a row takes its own slot's columns through a 0/1 mask
[T, R]: x A^T, times the mask, times B^T. So rows of any adapters (and none) share one pair of products per
weight, with no gather of factors per row; the mask depends only on the slots' column layout, so every weight with
the same layout (most weights of an adapter) shares one mask per step.

The step's slots are also kept as a Python set, so a module whose slots no row uses knows it without touching a
tensor (and without a host sync on a GPU). Each layout's mask is written, step after step, into the same buffer
(grown when a step has more rows), so what the native kernels are given to read it (tiermoe.layers.
fused_decode_layer) stays the same while the adapters loaded do.
Legend: T rows of the step, R rank columns of one stacked weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Columns = tuple[tuple[int, int], ...]  # (slot, rank) of each slot a stacked weight holds, in column order


@dataclass
class _Layout:
    """One column layout: its slots, each column's slot [R], and the buffer its masks are written into [rows, R]."""

    slots: frozenset[int]
    slot_R: torch.Tensor
    buffer: torch.Tensor


class AdapterRows:
    """The current step's slot per row (set by the engine around each forward; none between steps)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.slot_T: torch.Tensor | None = None  # [T] int64 on the main device while a step uses any adapter
        self.present: frozenset[int] = frozenset()  # the step's slots, 0 (the base model) included when a row has it
        self._masks: dict[Columns, torch.Tensor] = {}  # this step's masks by layout
        self._layouts: dict[Columns, _Layout] = {}  # kept across steps
        # changes whenever a mask may move (a layout made or forgotten, a buffer grown): with `present` it says
        # whether what a native call was given last step still points at this step's masks
        self.epoch = 0

    @property
    def active(self) -> bool:
        """Whether a row of the current step runs with an adapter."""
        return self.slot_T is not None

    @property
    def rows(self) -> int:
        return 0 if self.slot_T is None else self.slot_T.shape[0]

    def begin(self, slots: list[int]) -> None:
        """The step's rows, in the order the forward sees them: `slots[t]` is row t's slot (0: no adapter)."""
        self._masks.clear()
        self.present = frozenset(slots)
        if self.present <= {0}:
            self.slot_T = None
            return
        self.slot_T = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        with torch.inference_mode():  # buffers made inside a forward are inference tensors: written as such
            for columns in self._layouts:  # every known layout's mask now, so none moves during the step
                self.mask(columns)

    def end(self) -> None:
        self.slot_T, self.present = None, frozenset()
        self._masks.clear()

    def forget_layouts(self) -> None:
        """After an adapter loads or unloads: the old layouts are of no more use."""
        self._layouts.clear()
        self.epoch += 1

    def uses_any(self, slots: frozenset[int]) -> bool:
        """Whether a row of the current step has one of `slots`."""
        return self.slot_T is not None and not self.present.isdisjoint(slots)

    def uses_only(self, slots: frozenset[int]) -> bool:
        """Whether every row of the current step has one of `slots`."""
        return self.slot_T is not None and self.present <= slots

    def mask(self, columns: Columns) -> torch.Tensor | None:
        """fp32 [T, R] of `columns`' layout: 1 where row t's slot owns column r, else 0; None when no row of the
        step has one of its slots. Rows of the layout's buffer: valid for this step only."""
        if self.slot_T is None:
            return None
        layout = self._layouts.get(columns)
        if layout is None:
            slot_R = torch.tensor([slot for slot, rank in columns for _ in range(rank)], dtype=torch.int64)
            layout = self._layouts[columns] = _Layout(frozenset(slot for slot, _ in columns), slot_R.to(self.device),
                                                      torch.empty(0, len(slot_R), device=self.device))
            self.epoch += 1
        if self.present.isdisjoint(layout.slots):
            return None
        found = self._masks.get(columns)
        if found is None:
            rows = self.slot_T.shape[0]
            if layout.buffer.shape[0] < rows:
                layout.buffer = torch.empty(max(rows, 2 * layout.buffer.shape[0]), layout.buffer.shape[1],
                                            device=self.device)
                self.epoch += 1
            found = self._masks[columns] = layout.buffer[:rows]
            found.copy_(self.slot_T[:, None] == layout.slot_R[None, :])
        return found

    def rows_with(self, slots: frozenset[int]) -> torch.Tensor:
        """bool [T]: the rows whose slot is one of `slots` (call only while `uses_any(slots)`)."""
        wanted = torch.tensor(sorted(slots), dtype=torch.int64).to(self.device)
        return (self.slot_T[:, None] == wanted[None, :]).any(dim=1)
