"""Per-pass tensors on the device: the last N passes (circular) or all of them (growing), as SGLang buffers them.

SGLang's `--expert-distribution-recorder-buffer-size N` keeps the last N forward passes (`_CircularBuffer`; slot
p mod N, unfilled slots zero); -1 keeps every pass (`_InfiniteBuffer`, doubling its storage when full). This is
the same, with the pass index of every slot kept on the host so a dump can return the filled slots oldest first.
Legend: B slots, P passes held.
"""

from __future__ import annotations

import torch


class PassBuffer:
    def __init__(self, item_shape: tuple[int, ...], size: int, dtype: torch.dtype):
        if size == 0 or size < -1:
            raise ValueError(f"buffer size must be -1 (unbounded) or >= 1 passes, got {size}")
        self.item_shape = tuple(item_shape)
        self.size = size
        self.dtype = dtype
        self._data_B: torch.Tensor | None = None
        self._pass_of_slot: list[int] = []  # host: pass index held by each slot (-1: empty), in slot order

    def slot(self, pass_index: int, device: torch.device) -> torch.Tensor:
        """The zeroed item [*item_shape] that pass `pass_index` writes into (a view of the buffer).

        Called from `record`, inside the model's inference mode: the buffer is then an inference tensor, and
        every in-place update of it happens there too."""
        if self.size > 0:
            if self._data_B is None:
                self._data_B = torch.zeros(self.size, *self.item_shape, dtype=self.dtype, device=device)
                self._pass_of_slot = [-1] * self.size
            index = pass_index % self.size
            if self._pass_of_slot[index] >= 0:  # reused: forget the pass it held
                self._data_B[index].zero_()
            self._pass_of_slot[index] = pass_index
            return self._data_B[index]
        index = len(self._pass_of_slot)
        if self._data_B is None or index == self._data_B.shape[0]:
            grown = torch.zeros(max(16, 2 * index), *self.item_shape, dtype=self.dtype, device=device)
            if self._data_B is not None:
                grown[:index] = self._data_B
            self._data_B = grown
        self._pass_of_slot.append(pass_index)
        return self._data_B[index]

    def __len__(self) -> int:
        return sum(p >= 0 for p in self._pass_of_slot)

    def reset(self) -> None:
        self._data_B = None
        self._pass_of_slot = []

    def ordered(self) -> tuple[list[int], torch.Tensor]:
        """(pass indices, items [P, *item_shape] on the host), filled slots only, oldest pass first."""
        if self._data_B is None:
            return [], torch.zeros(0, *self.item_shape, dtype=self.dtype)
        filled = [i for i, p in enumerate(self._pass_of_slot) if p >= 0]
        order = sorted(filled, key=self._pass_of_slot.__getitem__)
        return [self._pass_of_slot[i] for i in order], self._data_B.to("cpu")[order]

    def slots(self) -> tuple[list[int], torch.Tensor]:
        """(pass index of each slot, -1 when empty; items [B, *item_shape] on the host) in slot order, as SGLang
        dumps its buffers: a circular buffer of N gives all N slots (pass p in slot p mod N, unfilled ones zero),
        an unbounded one every pass, oldest first."""
        if self.size > 0:
            if self._data_B is None:
                return [-1] * self.size, torch.zeros(self.size, *self.item_shape, dtype=self.dtype)
            return list(self._pass_of_slot), self._data_B.to("cpu", copy=True)
        held = len(self._pass_of_slot)
        data = torch.zeros(0, *self.item_shape, dtype=self.dtype) if self._data_B is None else self._data_B[:held]
        return list(self._pass_of_slot), data.to("cpu", copy=True)
