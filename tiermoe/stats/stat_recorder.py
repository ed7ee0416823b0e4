"""`stat` mode: routed-token counts per (layer, expert), kept on the device, dumped as SGLang's logical_count.

Legend: B buffer slots, L decoder layers (dense ones included, their rows stay zero), E experts, T rows of a
pass, K top-k. Phase axis: 0 prefill, 1 decode.

Design choices:
- Counts live in a PassBuffer of [2, L, E] int32 items on the device of the routed ids (int32 as SGLang's
  buffer), one item per forward pass. A record is one `index_add_` per run of same-phase rows into a view of the
  pass's item; slot, phase and layer are host integers, so nothing waits for the device (no .item(), .cpu(),
  bincount or nonzero before a dump).
- The buffer follows SGLang's `--expert-distribution-recorder-buffer-size`: N > 0 keeps the last N passes in a
  circular buffer (pass p counts into slot p mod N, a slot is cleared when it is reused; unfilled slots stay
  zero); -1 keeps every pass (the buffer grows). The dump's `logical_count` is therefore SGLang's: int32
  [N, L, E] in slot order, or [passes, L, E].
- Counts are split by phase (prefill rows vs decode rows of the same pass), so the dump carries the
  prefill/decode split exactly even when a pass mixes prefilling and decoding sequences.
- The buffer is created by the first record, inside the engine's inference mode, so it is an inference tensor.
- `stat_approx` (SGLang: DeepEP normal mode only) is recorded exactly as `stat`; the dump says which was asked.
- `average_utilization_rate_over_window` is None, as SGLang writes it unless EPLB rebalancing metrics are on
  (`--eplb-min-rebalancing-utilization-threshold` below 1): with one expert-parallel rank there is no imbalance
  between GPUs to measure.
"""

from __future__ import annotations

import torch

from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.pass_buffer import PassBuffer
from tiermoe.stats.pass_rows import check_rows, phase_runs, phase_tokens
from tiermoe.stats.recording import PassInfo
from tiermoe.stats.stat_header import dump_header


class StatRecorder:
    def __init__(self, shape: ModelShape, buffer_size: int = -1, mode: str = "stat"):
        if buffer_size == 0 or buffer_size < -1:
            raise ValueError(f"buffer_size must be -1 (unbounded) or >= 1 passes, got {buffer_size}")
        self.shape = shape
        self.buffer_size = buffer_size
        self.mode = mode
        self.enabled = True
        self._buffer = PassBuffer((2, shape.num_layers, shape.num_experts), buffer_size, torch.int32)
        self._ones: torch.Tensor | None = None  # reused source of index_add_: int32 ones on the device
        self._tokens: dict[int, tuple[int, int]] = {}  # pass index -> (prefill rows, decode rows), passes held
        self._passes = 0  # passes begun since the last reset
        self._pass_index = 0
        self._info: PassInfo | None = None
        self._runs: list[tuple[int, int, int]] = []
        self._slot_2LE: torch.Tensor | None = None

    # ---------------------------------------------------------------- ExpertRecorder protocol

    def begin_pass(self, info: PassInfo) -> None:
        self._info, self._runs, self._slot_2LE = info, phase_runs(info), None
        self._pass_index = self._passes
        self._passes += 1
        self._tokens[self._pass_index] = phase_tokens(info)
        if self.buffer_size > 0:  # the circular buffer forgets the pass this one replaces
            self._tokens.pop(self._pass_index - self.buffer_size, None)

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        if self._info is None:  # recording was switched on in the middle of a pass: wait for the next one
            return
        check_rows(self._info, layer, ids_TK, self.shape.top_k)
        if self._slot_2LE is None:  # first MoE layer of the pass: take (and clear) this pass's slot
            self._slot_2LE = self._buffer.slot(self._pass_index, ids_TK.device)
        ones = self._ones_on(ids_TK.device, ids_TK.numel())
        for start, end, phase in self._runs:
            ids = ids_TK[start:end].reshape(-1)
            self._slot_2LE[phase, layer].index_add_(0, ids, ones[:ids.numel()])

    def end_pass(self) -> None:
        self._info, self._runs, self._slot_2LE = None, [], None

    # ---------------------------------------------------------------- control (server start / stop / dump)

    def start(self) -> None:
        self.enabled = True

    def stop(self) -> None:
        self.enabled = False
        self.end_pass()

    def reset(self) -> None:
        self._buffer.reset()
        self._tokens = {}
        self._passes = 0
        self.end_pass()

    def dump(self) -> dict:
        """The stat dump: SGLang's keys (`rank`, `logical_count` int32 [B, L, E],
        `average_utilization_rate_over_window`) plus tiermoe's metadata under keys SGLang does not read.

        The only host-device synchronisation of this mode happens here, copying the counts to the host.
        """
        _, counts_B2LE = self._buffer.slots()
        prefill = sum(t[0] for t in self._tokens.values())
        decode = sum(t[1] for t in self._tokens.values())
        return {
            **dump_header(self.mode, self.shape, self.buffer_size),
            "logical_count": counts_B2LE.sum(dim=1, dtype=torch.int32),
            "average_utilization_rate_over_window": None,
            "logical_count_prefill": counts_B2LE[:, 0].sum(dim=0, dtype=torch.int64),
            "logical_count_decode": counts_B2LE[:, 1].sum(dim=0, dtype=torch.int64),
            "num_passes": len(self._tokens),
            "num_tokens": prefill + decode,
            "num_prefill_tokens": prefill,
            "num_decode_tokens": decode,
        }

    # ---------------------------------------------------------------- device buffers

    def _ones_on(self, device: torch.device, n: int) -> torch.Tensor:
        if self._ones is None or self._ones.numel() < n or self._ones.device != device:
            self._ones = torch.ones(max(n, 2 * (0 if self._ones is None else self._ones.numel()), 1024),
                                    dtype=torch.int32, device=device)
        return self._ones
