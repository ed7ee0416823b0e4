"""GPU-tier snapshots (SGLang-kt's `--record-kt-gpu-expert-distribution`): the mask in force at every pass.

Each MoE block hands the recorder its GPU mask [E] with every record; this recorder copies it into a per-pass
buffer [B, L, E] (bool, on the mask's device: a device-to-device copy, no synchronisation). The dump adds
`gpu_expert_masks` [B, L, E] in the buffer's slot order, as SGLang-kt dumps it (so slot i lines up with slot i of
a stat dump's `logical_count`: a circular buffer of N gives N slots, pass p in slot p mod N, unfilled ones False;
-1 gives every pass, oldest first; dense rows False) and `gpu_expert_masks_pass_index` [B] (-1: empty slot), so a
run can be checked afterwards against the placement it was meant to have. `tiermoe.stats.io` writes them to
SGLang's separate file `gpu_expert_distribution_{time}.pt`.
"""

from __future__ import annotations

import torch

from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.pass_buffer import PassBuffer
from tiermoe.stats.recording import PassInfo


class GpuMaskRecorder:
    def __init__(self, shape: ModelShape, buffer_size: int = -1):
        self.shape = shape
        self.enabled = True
        self._buffer = PassBuffer((shape.num_layers, shape.num_experts), buffer_size, torch.bool)
        self._passes = 0  # passes begun since the last reset
        self._pass_index = 0
        self._open = False
        self._slot_LE: torch.Tensor | None = None

    def begin_pass(self, info: PassInfo) -> None:
        self._open, self._slot_LE = True, None
        self._pass_index = self._passes
        self._passes += 1

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        if not self._open:
            return
        if self._slot_LE is None:  # first MoE layer of the pass: take this pass's slot
            self._slot_LE = self._buffer.slot(self._pass_index, gpu_mask_E.device)
        self._slot_LE[layer].copy_(gpu_mask_E)

    def end_pass(self) -> None:
        self._open, self._slot_LE = False, None

    def start(self) -> None:
        self.enabled = True

    def stop(self) -> None:
        self.enabled = False
        self.end_pass()

    def reset(self) -> None:
        self._buffer.reset()
        self._passes = 0
        self.end_pass()

    def dump(self) -> dict:
        passes, masks_BLE = self._buffer.slots()
        return {"gpu_expert_masks": masks_BLE, "gpu_expert_masks_pass_index": torch.tensor(passes, dtype=torch.int64)}
