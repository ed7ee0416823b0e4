"""`per_token` mode: a trace of every token of every forward pass and the experts it was routed to.

Trace format (the recorder's dump in memory, and tiermoe's earlier per_token files; tiermoe.stats.io now writes it
as SGLang's per_token `records`, see sglang_files, and sglang_records reads those back into this format;
N tokens, M MoE layers, K top-k):

    token_pass        int32 [N]     pass index, counted from 0 since recording (re)started
    token_request     int32 [N]     request id (the engine's sequence id) the token belongs to
    token_position    int32 [N]     the token's position in its own sequence (0 = first prompt token)
    token_is_prefill  bool  [N]     True for prompt tokens (prefill), False for decode tokens
    token_input_id    int32 [N]     the token's id (-1 where the pass did not say)
    topk_ids          int16 [N, M, K]  routed expert ids of the token at MoE layer moe_layers[m], in the
                                    router's order (int32 when the model has more than 32767 experts;
                                    -1 where a layer did not record, which a correct engine never leaves)
    moe_layers        list[int] [M] decoder-layer index of each M position
    logical_count     int64 [1, L, E]  the same routing summed per (layer, expert), so the trace also feeds
                                    `--init-expert-location`

Tokens are ordered by pass, and within a pass in the batch's row order (sequence by sequence, as PassInfo lists
them), so the requests that shared a batch are the distinct `token_request` values of one `token_pass`;
`passes_from_trace` rebuilds each pass's PassInfo. Plus the common header (model shape, mode, buffer size) and
`num_prefill_tokens` / `num_decode_tokens`.

Recording: every MoE layer copies its ids_TK into a per-pass [T, M, K] tensor on the device (no synchronisation);
finished passes are moved to the host in one go when they hold more than `flush_bytes` on the device, and at
the dump. `--expert-distribution-recorder-buffer-size N` keeps the last N passes.
"""

from __future__ import annotations

from collections import deque

import torch

from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.pass_rows import check_rows, row_table
from tiermoe.stats.recording import PassInfo
from tiermoe.stats.stat_header import dump_header


def _input_ids(info: PassInfo) -> torch.Tensor:
    """The pass's token ids [T], -1 where PassInfo has none."""
    if len(info.input_ids) == info.total_tokens:
        return torch.tensor(info.input_ids, dtype=torch.int32)
    return torch.full((info.total_tokens,), -1, dtype=torch.int32)


def ids_dtype(num_experts: int) -> torch.dtype:
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


class PerTokenRecorder:
    def __init__(self, shape: ModelShape, buffer_size: int = -1, flush_bytes: int = 64 << 20):
        if buffer_size == 0 or buffer_size < -1:
            raise ValueError(f"buffer_size must be -1 (unbounded) or >= 1 passes, got {buffer_size}")
        self.shape = shape
        self.buffer_size = buffer_size
        self.flush_bytes = flush_bytes
        self.enabled = True
        self._moe_index = shape.layer_to_moe_index
        # (pass index, (request [T], position [T], is_prefill [T], input id [T]) on the host, ids [T, M, K] device
        # or host)
        self._passes: deque = deque(maxlen=buffer_size if buffer_size > 0 else None)
        self._device_bytes = 0
        self._count = 0
        self._info: PassInfo | None = None
        self._ids_TMK: torch.Tensor | None = None

    def begin_pass(self, info: PassInfo) -> None:
        self._info, self._ids_TMK = info, None

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        if self._info is None:
            return
        check_rows(self._info, layer, ids_TK, self.shape.top_k)
        if layer not in self._moe_index:
            raise RuntimeError(f"layer {layer} recorded routed ids but is not a MoE layer {self.shape.moe_layers}")
        if self._ids_TMK is None:
            T, M, K = ids_TK.shape[0], len(self.shape.moe_layers), self.shape.top_k
            self._ids_TMK = torch.full((T, M, K), -1, dtype=ids_dtype(self.shape.num_experts), device=ids_TK.device)
        self._ids_TMK[:, self._moe_index[layer]].copy_(ids_TK)

    def end_pass(self) -> None:
        if self._info is not None and self._ids_TMK is not None:
            self._passes.append((self._count, (*row_table(self._info), _input_ids(self._info)), self._ids_TMK))
            self._count += 1
            if self._ids_TMK.device.type != "cpu":
                self._device_bytes += self._ids_TMK.numel() * self._ids_TMK.element_size()
                if self._device_bytes > self.flush_bytes:
                    self._to_host()
        self._info, self._ids_TMK = None, None

    def start(self) -> None:
        self.enabled = True

    def stop(self) -> None:
        self.enabled = False
        self.end_pass()

    def reset(self) -> None:
        self._passes.clear()
        self._device_bytes = 0
        self._count = 0
        self._info, self._ids_TMK = None, None

    def dump(self) -> dict:
        self._to_host()
        M, K = len(self.shape.moe_layers), self.shape.top_k
        entries = list(self._passes)
        ids_NMK = torch.cat([e[2] for e in entries]) if entries else torch.zeros(0, M, K, dtype=ids_dtype(
            self.shape.num_experts))
        column = lambda i, dtype: (torch.cat([e[1][i] for e in entries]) if entries  # noqa: E731
                                   else torch.zeros(0, dtype=dtype))
        token_pass = torch.cat([torch.full((e[2].shape[0],), e[0], dtype=torch.int32) for e in entries]) \
            if entries else torch.zeros(0, dtype=torch.int32)
        prefill = column(2, torch.bool)
        trace = {"topk_ids": ids_NMK, "moe_layers": list(self.shape.moe_layers)}
        return {
            **dump_header("per_token", self.shape, self.buffer_size),
            "token_pass": token_pass,
            "token_request": column(0, torch.int32),
            "token_position": column(1, torch.int32),
            "token_is_prefill": prefill,
            "token_input_id": column(3, torch.int32),
            **trace,
            "logical_count": counts_from_trace(trace, self.shape.num_layers, self.shape.num_experts)[None],
            "num_passes": len(entries),
            "num_tokens": int(prefill.numel()),
            "num_prefill_tokens": int(prefill.sum()),
            "num_decode_tokens": int((~prefill).sum()),
        }

    def _to_host(self) -> None:
        if self._device_bytes == 0:
            return
        for i, (index, rows, ids) in enumerate(self._passes):
            if ids.device.type != "cpu":
                self._passes[i] = (index, rows, ids.to("cpu"))
        self._device_bytes = 0


def counts_from_trace(trace: dict, num_layers: int, num_experts: int, select_N: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Routed-token counts int64 [L, E] of a trace (optionally of the tokens where bool `select_N` is True)."""
    ids_NMK = trace["topk_ids"] if select_N is None else trace["topk_ids"][select_N]
    counts_LE = torch.zeros(num_layers, num_experts, dtype=torch.int64)
    for m, layer in enumerate(trace["moe_layers"]):
        ids = ids_NMK[:, m].reshape(-1).long()
        ids = ids[ids >= 0]
        counts_LE[layer] = torch.bincount(ids, minlength=num_experts)[:num_experts]
    return counts_LE


def passes_from_trace(trace: dict) -> list[PassInfo]:
    """Each recorded pass as the PassInfo the engine announced: which requests shared it, how many rows each."""
    passes: list[PassInfo] = []
    pass_N, request_N = trace["token_pass"].tolist(), trace["token_request"].tolist()
    position_N, prefill_N = trace["token_position"].tolist(), trace["token_is_prefill"].tolist()
    input_N = trace["token_input_id"].tolist() if "token_input_id" in trace else [-1] * len(pass_N)
    n, i = len(pass_N), 0
    while i < n:
        rows: list[list] = []  # [request, num_tokens, start_position, is_prefill]
        p, first = pass_N[i], i
        while i < n and pass_N[i] == p:
            if rows and rows[-1][0] == request_N[i] and rows[-1][2] + rows[-1][1] == position_N[i]:
                rows[-1][1] += 1
            else:
                rows.append([request_N[i], 1, position_N[i], bool(prefill_N[i])])
            i += 1
        ids = tuple(input_N[first:i])
        passes.append(PassInfo(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows),
                               tuple(r[3] for r in rows), ids if -1 not in ids else ()))
    return passes
