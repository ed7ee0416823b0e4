"""Reading SGLang's per_pass / per_token files (`records` + `last_physical_to_logical_map`, see sglang_files):
written by SGLang itself or by tiermoe (whose extra keys make the conversion exact).

`from_records(data, source)` turns such a file into the dicts the rest of tiermoe.stats reads:
- per_pass: tiermoe's per_pass dump (`logical_count` [P, L, E], `pass_index`, rows per pass) when the file carries
  tiermoe's extras, else a plain `{"logical_count": [P, L, E]}`;
- per_token: tiermoe's per_token trace (tiermoe.stats.traces format).
Physical expert ids become logical ones through `last_physical_to_logical_map`. What SGLang's records do not say is
filled in as follows: sequences are `extend_seq_lens` (one token each in a decode pass), each its own request (SGLang
does not record request ids); a token is prefill in an extend pass, decode in a decode pass, and in a mixed pass
prefill when its sequence has more than one token; MoE layers are the layers with any routed id; top-k is the
widest row of ids.
"""

from __future__ import annotations

import torch

from tiermoe.errors import TiermoeError
from tiermoe.stats.stat_header import DUMP_FORMAT
from tiermoe.stats.traces import counts_from_trace, ids_dtype

FORWARD_MODE_EXTEND, FORWARD_MODE_MIXED = 1, 3


def is_records_file(data) -> bool:
    return isinstance(data, dict) and isinstance(data.get("records"), list)


def from_records(data: dict, source: str) -> dict:
    records = data["records"]
    if not all(isinstance(r, dict) for r in records):
        raise TiermoeError(f"'{source}' has records that are not dicts; expected SGLang's per_pass/per_token layout")
    map_LE = _physical_to_logical(data, source)
    if not records:
        raise TiermoeError(f"'{source}' holds no records (nothing was recorded before the dump)")
    if all("topk_ids_of_layer" in r for r in records):
        return _per_token(data, records, map_LE, source)
    if all("global_physical_count" in r for r in records):
        return _per_pass(data, records, map_LE, source)
    raise TiermoeError(f"'{source}' has records with neither 'topk_ids_of_layer' (per_token) nor "
                       "'global_physical_count' (per_pass)")


def _physical_to_logical(data: dict, source: str) -> torch.Tensor:
    map_LE = data.get("last_physical_to_logical_map")
    if not isinstance(map_LE, torch.Tensor) or map_LE.dim() != 2 or map_LE.is_floating_point() or (
            map_LE.numel() and int(map_LE.min()) < 0):
        raise TiermoeError(f"'{source}' has no valid last_physical_to_logical_map [layers, physical experts]")
    return map_LE.long()


def _num_experts(data: dict, map_LE: torch.Tensor) -> int:
    return int(data.get("num_experts") or (int(map_LE.max()) + 1 if map_LE.numel() else 0))


def _logical(phys_LX: torch.Tensor, map_LE: torch.Tensor, num_experts: int, source: str) -> torch.Tensor:
    if not isinstance(phys_LX, torch.Tensor) or phys_LX.shape != map_LE.shape:
        got = list(phys_LX.shape) if isinstance(phys_LX, torch.Tensor) else type(phys_LX).__name__
        raise TiermoeError(f"'{source}' has a record count of shape {got}; expected {list(map_LE.shape)} "
                           "(layers x physical experts, as last_physical_to_logical_map)")
    out = torch.zeros(map_LE.shape[0], num_experts, dtype=torch.int64)
    return out.scatter_add_(1, map_LE, phys_LX.long())


def _per_pass(data: dict, records: list[dict], map_LE: torch.Tensor, source: str) -> dict:
    E = _num_experts(data, map_LE)
    counts_PLE = torch.stack([_logical(r["global_physical_count"], map_LE, E, source) for r in records])
    rows = ("num_prefill_tokens", "num_decode_tokens", "num_sequences")
    if data.get("format") != DUMP_FORMAT or not all(k in r for r in records for k in rows):
        return {"logical_count": counts_PLE, "source_kind": "sglang per_pass"}
    header = {k: v for k, v in data.items() if k not in ("records", "last_physical_to_logical_map", *rows)}
    column = lambda key: torch.tensor([int(r[key]) for r in records], dtype=torch.int64)  # noqa: E731
    return {**header, "logical_count": counts_PLE,
            "pass_index": torch.tensor([int(r["forward_pass_id"]) for r in records], dtype=torch.int64),
            **{k: column(k) for k in rows}}


def _per_token(data: dict, records: list[dict], map_LE: torch.Tensor, source: str) -> dict:
    L, E = map_LE.shape[0], _num_experts(data, map_LE)
    ids = []
    for r in records:
        topk = r["topk_ids_of_layer"]
        if not isinstance(topk, torch.Tensor) or topk.dim() != 3 or topk.shape[0] != L or topk.is_floating_point():
            raise TiermoeError(f"'{source}' has a topk_ids_of_layer that is not an integer [{L}, tokens, top-k] tensor")
        topk = topk.long()
        if topk.numel() and int(topk.max()) >= map_LE.shape[1]:
            raise TiermoeError(f"'{source}' routes to physical expert {int(topk.max())}; the map has "
                               f"{map_LE.shape[1]}")
        valid = topk >= 0
        logical = torch.gather(map_LE[:, None, :].expand(L, topk.shape[1], -1), 2, topk.clamp(min=0))
        ids.append(torch.where(valid, logical, torch.full_like(logical, -1)))
    tiermoe = data.get("format") == DUMP_FORMAT
    routed_L = torch.stack([(t >= 0).flatten(1).any(dim=1) for t in ids]).any(dim=0)
    moe_layers = list(data["moe_layers"]) if tiermoe else routed_L.nonzero().flatten().tolist()
    routed_K = torch.stack([(t >= 0).flatten(0, 1).any(dim=0) for t in ids]).any(dim=0)
    top_k = int(data["top_k"]) if tiermoe else int(routed_K.nonzero().max()) + 1 if bool(routed_K.any()) else 1
    columns: dict[str, list] = {"pass": [], "request": [], "position": [], "prefill": []}
    next_request = 0
    for r, t in zip(records, ids):
        T = t.shape[1]
        lens, requests, prefill = _sequences(r, T, source)
        if requests is None:
            requests, next_request = list(range(next_request, next_request + len(lens))), next_request + len(lens)
        columns["pass"] += [int(r["forward_pass_id"])] * T
        columns["position"] += list(r.get("positions") or range(T))[:T]
        for n, request, pre in zip(lens, requests, prefill):
            columns["request"] += [int(request)] * n
            columns["prefill"] += [bool(pre)] * n
    trace = {
        "token_pass": torch.tensor(columns["pass"], dtype=torch.int32),
        "token_request": torch.tensor(columns["request"], dtype=torch.int32),
        "token_position": torch.tensor(columns["position"], dtype=torch.int32),
        "token_is_prefill": torch.tensor(columns["prefill"], dtype=torch.bool),
        "topk_ids": torch.cat([t[moe_layers, :, :top_k].permute(1, 0, 2) for t in ids]).to(ids_dtype(E)),
        "moe_layers": moe_layers,
    }
    prefill_N = trace["token_is_prefill"]
    header = {k: v for k, v in data.items() if k not in ("records", "last_physical_to_logical_map")} if tiermoe else {
        "format": DUMP_FORMAT, "mode": "per_token", "num_layers": L, "num_experts": E, "top_k": top_k,
        "moe_layers": moe_layers, "source_kind": "sglang per_token"}
    return {**header, **trace, "logical_count": counts_from_trace(trace, L, E)[None],
            "num_passes": len(records), "num_tokens": int(prefill_N.numel()),
            "num_prefill_tokens": int(prefill_N.sum()), "num_decode_tokens": int((~prefill_N).sum())}


def _sequences(record: dict, T: int, source: str) -> tuple[list[int], list | None, list[bool]]:
    """(tokens per sequence, request ids or None when the file has none, prefill per sequence) of one pass."""
    if all(k in record for k in ("seq_lens", "request_ids", "seq_is_prefill")):  # tiermoe's extras: exact
        lens, requests, prefill = list(record["seq_lens"]), list(record["request_ids"]), list(record["seq_is_prefill"])
    else:
        mode = record.get("forward_mode")
        lens = list(record.get("extend_seq_lens") or []) if mode in (FORWARD_MODE_EXTEND, FORWARD_MODE_MIXED) else []
        lens = lens or [1] * T
        requests = None
        prefill = [mode == FORWARD_MODE_EXTEND or (mode == FORWARD_MODE_MIXED and n > 1) for n in lens]
    if sum(lens) != T or len(requests if requests is not None else lens) != len(lens) or len(prefill) != len(lens):
        raise TiermoeError(f"'{source}' has a record (forward pass {record.get('forward_pass_id')}) whose sequences "
                           f"hold {sum(lens)} tokens, but its topk_ids_of_layer hold {T}")
    return [int(n) for n in lens], requests, prefill
