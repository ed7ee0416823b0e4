"""The rows of one forward pass, as the recorders need them (pure functions of a PassInfo).

A pass's rows are its sequences' tokens in PassInfo order; a sequence is wholly prefill or wholly decode within
one pass, so the prefill rows and decode rows form contiguous runs. Recorders slice `ids_TK` by these runs with
host integers, which costs no host-device synchronisation.
"""

from __future__ import annotations

import torch

from tiermoe.stats.recording import PassInfo

PREFILL, DECODE = 0, 1


def phase_runs(info: PassInfo) -> list[tuple[int, int, int]]:
    """[(first_row, end_row, phase)] with adjacent sequences of the same phase merged (phase PREFILL or DECODE)."""
    runs: list[tuple[int, int, int]] = []
    row = 0
    for n, prefill in zip(info.num_tokens, info.is_prefill):
        phase = PREFILL if prefill else DECODE
        if n == 0:
            continue
        if runs and runs[-1][2] == phase and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + n, phase)
        else:
            runs.append((row, row + n, phase))
        row += n
    return runs


def phase_tokens(info: PassInfo) -> tuple[int, int]:
    """(prefill tokens, decode tokens) of the pass."""
    prefill = sum(n for n, p in zip(info.num_tokens, info.is_prefill) if p)
    return prefill, info.total_tokens - prefill


def row_table(info: PassInfo) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of the pass (on the host): request id int32 [T], position int32 [T], is_prefill bool [T]."""
    requests, positions, prefill = [], [], []
    for rid, n, start, p in zip(info.request_ids, info.num_tokens, info.start_positions, info.is_prefill):
        requests += [rid] * n
        positions += range(start, start + n)
        prefill += [p] * n
    return (torch.tensor(requests, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32),
            torch.tensor(prefill, dtype=torch.bool))


def check_rows(info: PassInfo | None, layer: int, ids_TK: torch.Tensor, top_k: int) -> None:
    """A block recorded rows that do not belong to the announced pass: a wiring bug, so fail loudly."""
    if info is None:
        return
    if ids_TK.dim() != 2 or ids_TK.shape[0] != info.total_tokens or ids_TK.shape[1] != top_k:
        raise RuntimeError(f"layer {layer} recorded routed ids of shape {list(ids_TK.shape)}; the pass announced "
                           f"{info.total_tokens} rows x top-k {top_k}")
