"""A recorder in front of another that holds one forward pass's records until the pass is known to have succeeded.

A step that fails is re-run in parts to find the failing sequence (tiermoe.engine.step_isolation): recorded as it
runs, the failed forward and every failed part would count their tokens again. Held here, a failed pass is
dropped and a good one reaches the real recorder whole, in the order it was recorded (begin, records, end).
"""

from __future__ import annotations

import torch

from tiermoe.stats.recording import ExpertRecorder, PassInfo


class PassTransaction:
    def __init__(self, inner: ExpertRecorder):
        self.inner = inner
        self._info: PassInfo | None = None
        self._records: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    @property
    def enabled(self) -> bool:  # recorders turn on and off between steps (the recorder endpoints)
        return self.inner.enabled

    def begin_pass(self, info: PassInfo) -> None:
        self._info, self._records = info, []

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        if self._info is None:  # a forward outside a pass (Engine.forward_batch): as it comes
            self.inner.record(layer, ids_TK, gpu_mask_E)
            return
        self._records.append((layer, ids_TK, gpu_mask_E))  # held, not copied: callers hand over fresh tensors

    def end_pass(self) -> None:
        """Nothing yet: the engine commits or discards once it knows whether the pass raised."""

    def commit(self) -> None:
        info, records = self._info, self._records
        self._info, self._records = None, []
        self.inner.begin_pass(info)
        for layer, ids_TK, gpu_mask_E in records:
            self.inner.record(layer, ids_TK, gpu_mask_E)
        self.inner.end_pass()

    def discard(self) -> None:
        self._info, self._records = None, []
