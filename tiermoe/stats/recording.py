"""The recorder interface the engine and the HybridMoE blocks drive (implementations live beside it).

A recorder is passed in (Engine(recorder=...)), never a global. Per forward pass the engine calls
begin_pass(PassInfo) with the batch's rows in order, every MoE block calls record(layer, ids_TK, gpu_mask_E)
with the routed expert ids of those same rows, and the engine calls end_pass(). When `enabled` is False,
nobody calls anything and no tensor work is done. The tensors handed to record() are never changed afterwards (a
recorder may keep them), and a pass reaches a recorder only once it succeeded (tiermoe.stats.pass_transaction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class PassInfo:
    """The rows of one forward pass, in order: sequence i contributes num_tokens[i] consecutive rows."""

    request_ids: tuple[int, ...]
    num_tokens: tuple[int, ...]
    start_positions: tuple[int, ...]  # position of each sequence's first row in its own sequence
    is_prefill: tuple[bool, ...]
    input_ids: tuple[int, ...] = ()  # every row's token id, in row order (empty where the caller has none)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class ExpertRecorder(Protocol):
    enabled: bool

    def begin_pass(self, info: PassInfo) -> None: ...

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None: ...

    def end_pass(self) -> None: ...


class NoOpRecorder:
    """Recording off: `enabled` is False, so the engine and blocks never call it (and it would do nothing)."""

    enabled = False

    def begin_pass(self, info: PassInfo) -> None:
        pass

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        pass

    def end_pass(self) -> None:
        pass


NO_RECORDER = NoOpRecorder()  # stateless, so one shared instance is safe
