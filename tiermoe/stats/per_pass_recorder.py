"""`per_pass` mode: routed-token counts [L, E] kept separately for every forward pass.

Each pass takes a slot of a PassBuffer [B, L, E] (int32, on the device; the last N passes or all of them, as
`--expert-distribution-recorder-buffer-size` says) and every MoE layer adds its routed ids with one `index_add_`.
Per pass the host keeps how many prefill and decode rows it had and how many sequences.

Dump (in memory; tiermoe.stats.io writes it as SGLang's per_pass `records`, see sglang_files), besides the
common header: `logical_count` int64 [P, L, E], the per-pass counts oldest first (so the file
also feeds `--init-expert-location`, which sums over the first axis), `pass_index` int64 [P],
`num_prefill_tokens` / `num_decode_tokens` / `num_sequences` int64 [P]. A pass is prefill when it has only
prefill rows, decode when only decode rows, mixed otherwise.
"""

from __future__ import annotations

import torch

from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.pass_buffer import PassBuffer
from tiermoe.stats.pass_rows import check_rows, phase_tokens
from tiermoe.stats.recording import PassInfo
from tiermoe.stats.stat_header import dump_header


class PerPassRecorder:
    def __init__(self, shape: ModelShape, buffer_size: int = -1):
        self.shape = shape
        self.buffer_size = buffer_size
        self.enabled = True
        self._buffer = PassBuffer((shape.num_layers, shape.num_experts), buffer_size, torch.int32)
        self._rows: dict[int, tuple[int, int, int]] = {}  # pass index -> (prefill rows, decode rows, sequences)
        self._passes = 0
        self._info: PassInfo | None = None
        self._slot_LE: torch.Tensor | None = None
        self._ones: torch.Tensor | None = None

    def begin_pass(self, info: PassInfo) -> None:
        self._info, self._slot_LE = info, None
        self._pass_index = self._passes
        self._passes += 1
        self._rows[self._pass_index] = (*phase_tokens(info), len(info.request_ids))
        if self.buffer_size > 0:  # the circular buffer forgets the pass this one replaces
            self._rows.pop(self._pass_index - self.buffer_size, None)

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        if self._info is None:
            return
        check_rows(self._info, layer, ids_TK, self.shape.top_k)
        if self._slot_LE is None:
            self._slot_LE = self._buffer.slot(self._pass_index, ids_TK.device)
        if self._ones is None or self._ones.numel() < ids_TK.numel() or self._ones.device != ids_TK.device:
            self._ones = torch.ones(max(1024, 2 * ids_TK.numel()), dtype=torch.int32, device=ids_TK.device)
        ids = ids_TK.reshape(-1)
        self._slot_LE[layer].index_add_(0, ids, self._ones[:ids.numel()])

    def end_pass(self) -> None:
        self._info, self._slot_LE = None, None

    def start(self) -> None:
        self.enabled = True

    def stop(self) -> None:
        self.enabled = False
        self.end_pass()

    def reset(self) -> None:
        self._buffer.reset()
        self._rows = {}
        self._passes = 0
        self.end_pass()

    def dump(self) -> dict:
        passes, counts_PLE = self._buffer.ordered()
        rows = [self._rows[p] for p in passes]
        column = lambda i: torch.tensor([r[i] for r in rows], dtype=torch.int64)  # noqa: E731
        prefill, decode = column(0), column(1)
        return {
            **dump_header("per_pass", self.shape, self.buffer_size),
            "logical_count": counts_PLE.to(torch.int64),
            "pass_index": torch.tensor(passes, dtype=torch.int64),
            "num_prefill_tokens": prefill,
            "num_decode_tokens": decode,
            "num_sequences": column(2),
            "num_passes": len(passes),
            "num_tokens": int(prefill.sum() + decode.sum()),
        }
