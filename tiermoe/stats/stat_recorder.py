"""`stat` mode: routed-token counts per (layer, expert), kept on the device, dumped as SGLang's logical_count.

Legend: B buffer slots, L decoder layers (dense ones included, their rows stay zero), E experts, T rows of a
pass, K top-k. Phase axis: 0 prefill, 1 decode.

Design choices:
- Counts live in one int64 tensor counts_B2LE on the device of the routed ids, created at the first record.
  A record is one `index_add_` per run of same-phase rows into a view of that tensor; slot, phase and layer are
  host integers, so nothing waits for the device (no .item(), .cpu(), bincount or nonzero before a dump).
- The buffer follows SGLang's `--expert-distribution-recorder-buffer-size`: N > 0 keeps the last N passes in a
  circular buffer (pass p counts into slot p mod N, a slot is cleared when it is reused; unfilled slots stay
  zero); -1 is unbounded. SGLang's unbounded buffer grows by one [L, E] slot per pass, although the stat dump is
  only ever summed over passes; tiermoe keeps one accumulating slot instead (B = 1), so memory stays constant and
  the sum is identical. Per-pass counts are what `per_pass` mode is for.
- Counts are split by phase (prefill rows vs decode rows of the same pass), so the dump carries the
  prefill/decode split exactly even when a pass mixes prefilling and decoding sequences.
- The buffer is created by the first record, inside the engine's inference mode, so it is an inference tensor;
  the in-place updates made outside the model (clearing a slot, reset) enter inference mode too.
- `stat_approx` (SGLang: DeepEP normal mode only) is recorded exactly as `stat`; the dump says which was asked.
"""

from __future__ import annotations

import torch

from tiermoe.stats.model_shape import ModelShape
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
        self._slots = 1 if buffer_size < 0 else buffer_size
        self._counts_B2LE: torch.Tensor | None = None
        self._ones: torch.Tensor | None = None  # reused source of index_add_: int64 ones on the device
        self._tokens_B2 = [[0, 0] for _ in range(self._slots)]  # host ints: prefill/decode tokens per slot
        self._passes = 0  # passes begun since the last reset
        self._info: PassInfo | None = None
        self._runs: list[tuple[int, int, int]] = []
        self._slot = 0

    # ---------------------------------------------------------------- ExpertRecorder protocol

    def begin_pass(self, info: PassInfo) -> None:
        self._slot = 0 if self.buffer_size < 0 else self._passes % self._slots
        if self.buffer_size > 0 and self._passes >= self._slots:  # reusing a slot: forget the pass it held
            if self._counts_B2LE is not None:
                with torch.inference_mode():  # the buffer was made inside the model's inference mode
                    self._counts_B2LE[self._slot].zero_()
            self._tokens_B2[self._slot] = [0, 0]
        self._info, self._runs = info, phase_runs(info)
        prefill, decode = phase_tokens(info)
        self._tokens_B2[self._slot][0] += prefill
        self._tokens_B2[self._slot][1] += decode
        self._passes += 1

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        if self._info is None:  # recording was switched on in the middle of a pass: wait for the next one
            return
        check_rows(self._info, layer, ids_TK, self.shape.top_k)
        counts_B2LE = self._counts_on(ids_TK.device)
        ones = self._ones_on(ids_TK.device, ids_TK.numel())
        for start, end, phase in self._runs:
            ids = ids_TK[start:end].reshape(-1)
            counts_B2LE[self._slot, phase, layer].index_add_(0, ids, ones[:ids.numel()])

    def end_pass(self) -> None:
        self._info, self._runs = None, []

    # ---------------------------------------------------------------- control (server start / stop / dump)

    def start(self) -> None:
        self.enabled = True

    def stop(self) -> None:
        self.enabled = False
        self.end_pass()

    def reset(self) -> None:
        if self._counts_B2LE is not None:
            with torch.inference_mode():
                self._counts_B2LE.zero_()
        self._tokens_B2 = [[0, 0] for _ in range(self._slots)]
        self._passes = 0
        self.end_pass()

    def dump(self) -> dict:
        """The stat dump: SGLang's keys (`rank`, `logical_count` int64 [B, L, E]) plus tiermoe's metadata.

        The only host-device synchronisation of this mode happens here, copying the counts to the host.
        """
        L, E = self.shape.num_layers, self.shape.num_experts
        if self._counts_B2LE is None:
            counts_B2LE = torch.zeros(self._slots, 2, L, E, dtype=torch.int64)
        else:
            counts_B2LE = self._counts_B2LE.to("cpu", copy=True)
        prefill = sum(t[0] for t in self._tokens_B2)
        decode = sum(t[1] for t in self._tokens_B2)
        passes = self._passes if self.buffer_size < 0 else min(self._passes, self._slots)
        return {
            **dump_header(self.mode, self.shape, self.buffer_size),
            "logical_count": counts_B2LE.sum(dim=1),
            "logical_count_prefill": counts_B2LE[:, 0].sum(dim=0),
            "logical_count_decode": counts_B2LE[:, 1].sum(dim=0),
            "num_passes": passes,
            "num_tokens": prefill + decode,
            "num_prefill_tokens": prefill,
            "num_decode_tokens": decode,
        }

    # ---------------------------------------------------------------- device buffers

    def _counts_on(self, device: torch.device) -> torch.Tensor:
        if self._counts_B2LE is None:
            L, E = self.shape.num_layers, self.shape.num_experts
            self._counts_B2LE = torch.zeros(self._slots, 2, L, E, dtype=torch.int64, device=device)
        return self._counts_B2LE

    def _ones_on(self, device: torch.device, n: int) -> torch.Tensor:
        if self._ones is None or self._ones.numel() < n or self._ones.device != device:
            self._ones = torch.ones(max(n, 2 * (0 if self._ones is None else self._ones.numel()), 1024),
                                    dtype=torch.int64, device=device)
        return self._ones
