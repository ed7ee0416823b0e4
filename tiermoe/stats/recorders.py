"""Building a recorder from SGLang's recorder settings, and running several as one.

`make_recorder(mode, shape, buffer_size, record_gpu_masks)`:
- mode None: NO_RECORDER (recording off: the engine and the blocks never call it, so no tensor work at all);
- "stat" / "stat_approx" (the same, see stat_recorder), "per_pass", "per_token";
- record_gpu_masks adds GPU-tier snapshots (SGLang-kt needs a mode for them too).
A RecorderGroup forwards every call to its members and merges their dumps, so snapshots ride along any mode.
"""

from __future__ import annotations

import torch

from tiermoe.errors import TiermoeError
from tiermoe.stats.gpu_mask_recorder import GpuMaskRecorder
from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.per_pass_recorder import PerPassRecorder
from tiermoe.stats.recording import NO_RECORDER, PassInfo
from tiermoe.stats.stat_recorder import StatRecorder
from tiermoe.stats.traces import PerTokenRecorder

MODES = ("stat", "stat_approx", "per_pass", "per_token")
SGLANG_DEFAULT_BUFFER_SIZE = 1000  # SGLang: None -> eplb_rebalance_num_iterations, 1000 by default


class RecorderGroup:
    """Several recorders driven as one (e.g. stat counts plus GPU-tier snapshots).

    Enabled while any member is; calls go to the enabled members only, so one member can be stopped while
    another keeps recording. The engine also groups its recorders with it (Engine.add_recorder).
    """

    def __init__(self, *members):
        self.members = tuple(m for m in members if m is not None)

    @property
    def enabled(self) -> bool:
        return any(m.enabled for m in self.members)

    def begin_pass(self, info: PassInfo) -> None:
        for m in self.members:
            if m.enabled:
                m.begin_pass(info)

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        for m in self.members:
            if m.enabled:
                m.record(layer, ids_TK, gpu_mask_E)

    def end_pass(self) -> None:
        for m in self.members:
            if m.enabled:
                m.end_pass()

    def start(self) -> None:
        for m in self.members:
            m.start()

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def reset(self) -> None:
        for m in self.members:
            m.reset()

    def dump(self) -> dict:
        out: dict = {}
        for m in self.members:
            out.update(m.dump())
        return out


def make_recorder(mode: str | None, shape: ModelShape, buffer_size: int | None = None,
                  record_gpu_masks: bool = False):
    """The recorder for SGLang's flags; buffer_size None = SGLang's default (1000 passes), -1 = unbounded."""
    if mode is None:
        if record_gpu_masks:
            raise TiermoeError("--record-kt-gpu-expert-distribution needs --expert-distribution-recorder-mode "
                               f"({', '.join(MODES)})")
        return NO_RECORDER
    if mode not in MODES:
        raise TiermoeError(f"expert distribution recorder mode '{mode}' is unknown; choose one of: {', '.join(MODES)}")
    size = SGLANG_DEFAULT_BUFFER_SIZE if buffer_size is None else int(buffer_size)
    if size == 0 or size < -1:
        raise TiermoeError(f"--expert-distribution-recorder-buffer-size must be -1 (unbounded) or >= 1 passes, "
                           f"got {size}")
    if mode in ("stat", "stat_approx"):
        recorder = StatRecorder(shape, size, mode)
    elif mode == "per_pass":
        recorder = PerPassRecorder(shape, size)
    else:
        recorder = PerTokenRecorder(shape, size)
    return RecorderGroup(recorder, GpuMaskRecorder(shape, size)) if record_gpu_masks else recorder
