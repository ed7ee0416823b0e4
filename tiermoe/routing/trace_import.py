"""Routing published by other tools, read into tiermoe's trace dict (or a heat-matrix dict) for `tiermoe trace
convert`, which writes them as the text formats of docs/traces.md.

Layouts (`--from`):
- `esft-trace`: deepseek-ai/ESFT's expert scores as text: `#` header lines (with `ALPH=...`), then one line per
  token `<seq> <pos> g1 ... gM`, group m = the top-k ids of MoE layer m as characters of ALPH. The groups are the
  MoE layers `first_moe_layer`.. (DeepSeek-V2-Lite: decoder layers 1..26 of 27). Teacher-forced text: every
  token is written as a decode token (one per step), as cache studies replay it.
- `esft-counts`: ESFT's `counts_<task>.csv`, rows = MoE layers from `first_moe_layer`, no header -> heat matrix.
- `route-trace`: BigMoeOnEdge's `route_trace v1` CSV (`turn,phase,step,layer,slot,expert,...`, metadata in `#`
  lines: n_layer, n_expert, n_expert_used): seq = turn, pos = step, phase 0 = prefill, ids in slot order.
- `heat`: a `layer,e0,e1,...` heat matrix (e.g. mbolt's heat_*.csv): checked and rewritten with its metadata.
- `sglang`: SGLang's per_token dump (`--expert-distribution-recorder-mode per_token`, `records` of
  `topk_ids_of_layer [num_layers, T, 8]` physical ids, `positions`, `extend_seq_lens`), mapped to logical ids with
  `last_physical_to_logical_map`. Its records carry no request id: a row continues the sequence whose last token
  was at the previous position (first such, in order), else starts a new one.
- `tiermoe`: a tiermoe `.pt` dump: a per_token trace, or counts (any statistics file) -> heat matrix.
Legend: N tokens, M MoE layers, K top-k, L layers, E experts.
"""

from __future__ import annotations

from collections import defaultdict, deque
from pathlib import Path

import torch

from tiermoe.errors import TiermoeError
from tiermoe.stats.stat_header import DUMP_FORMAT, DUMP_VERSION
from tiermoe.stats.trace_csv import read_metadata
from tiermoe.stats.traces import counts_from_trace, ids_dtype

LAYOUTS = ("esft-trace", "esft-counts", "route-trace", "heat", "sglang", "tiermoe")


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise TiermoeError(f"cannot read '{path}': {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise TiermoeError(f"'{path}' is not a text file") from None


def trace_dict(token_rows: list[tuple[int, int, bool, int]], ids_NMK: torch.Tensor, moe_layers: list[int],
               num_layers: int, num_experts: int, model_type: str, source_kind: str) -> dict:
    """A per_token trace dict from per-token (seq, pos, prefill, pass) and ids [N, M, K] (-1 = missing)."""
    table = torch.tensor(token_rows, dtype=torch.int64).reshape(-1, 4)
    prefill_N = table[:, 2].bool()
    trace = {
        "format": DUMP_FORMAT, "format_version": DUMP_VERSION, "mode": "per_token", "rank": 0,
        "model_type": model_type, "num_layers": num_layers, "num_experts": num_experts, "top_k": ids_NMK.shape[2],
        "moe_layers": list(moe_layers), "buffer_size": -1, "source_kind": source_kind,
        "token_pass": table[:, 3].to(torch.int32), "token_request": table[:, 0].to(torch.int32),
        "token_position": table[:, 1].to(torch.int32), "token_is_prefill": prefill_N,
        "topk_ids": ids_NMK.to(ids_dtype(num_experts)),
    }
    trace["logical_count"] = counts_from_trace(trace, num_layers, num_experts)[None]
    trace.update(num_tokens=len(token_rows), num_prefill_tokens=int(prefill_N.sum()),
                 num_decode_tokens=int((~prefill_N).sum()))
    return trace


def heat_dict(counts_LE: torch.Tensor, moe_layers: list[int], model_type: str = "unknown",
              top_k: int | None = None) -> dict:
    return {"format": DUMP_FORMAT, "mode": "stat", "num_layers": counts_LE.shape[0],
            "num_experts": counts_LE.shape[1], "moe_layers": list(moe_layers), "top_k": top_k,
            "model_type": model_type, "source_kind": "heat csv", "logical_count": counts_LE[None]}


def read_esft_trace(path: Path, first_moe_layer: int = 1) -> dict:
    lines = _lines(path)
    comments = [x for x in lines if x.startswith("#")]
    alphabet = read_metadata(comments).get("ALPH")
    if not alphabet:
        raise TiermoeError(f"'{path}' has no '# ALPH=...' header line: not an ESFT expert-score trace")
    index = {c: i for i, c in enumerate(alphabet)}
    tokens, groups = [], []
    for number, line in enumerate(lines, 1):
        if line.startswith("#") or not line.strip():
            continue
        fields = line.split()
        try:
            seq, pos = int(fields[0]), int(fields[1])
            ids = [[index[c] for c in group] for group in fields[2:]]
        except (ValueError, KeyError, IndexError):
            raise TiermoeError(f"'{path}' line {number}: expected '<seq> <pos>' and groups of ALPH "
                               "characters") from None
        if groups and (len(ids) != len(groups[0]) or any(len(g) != len(groups[0][0]) for g in ids)):
            raise TiermoeError(f"'{path}' line {number}: {len(ids)} groups, the first token has "
                               f"{len(groups[0])} groups of {len(groups[0][0])}")
        if not ids:
            raise TiermoeError(f"'{path}' line {number}: no expert groups")
        tokens.append((seq, pos, False, len(tokens)))
        groups.append(ids)
    if not tokens:
        raise TiermoeError(f"'{path}' holds no token lines")
    m = len(groups[0])
    layers = list(range(first_moe_layer, first_moe_layer + m))
    model = "deepseek_v2" if "DeepSeek-V2" in " ".join(comments) else "unknown"
    return trace_dict(tokens, torch.tensor(groups), layers, layers[-1] + 1, len(alphabet), model, "esft trace")


def read_esft_counts(path: Path, first_moe_layer: int = 1) -> dict:
    rows = []
    for number, line in enumerate(_lines(path), 1):
        if line.startswith("#") or not line.strip():
            continue
        try:
            rows.append([float(x) for x in line.split(",")])
        except ValueError:
            raise TiermoeError(f"'{path}' line {number}: expected comma-separated counts") from None
        if len(rows[-1]) != len(rows[0]):
            raise TiermoeError(f"'{path}' line {number}: {len(rows[-1])} counts, the first row has {len(rows[0])}")
    if not rows:
        raise TiermoeError(f"'{path}' holds no rows")
    layers = list(range(first_moe_layer, first_moe_layer + len(rows)))
    counts_LE = torch.zeros(layers[-1] + 1, len(rows[0]), dtype=torch.float64)
    counts_LE[layers] = torch.tensor(rows, dtype=torch.float64)
    return heat_dict(counts_LE.long() if counts_LE.eq(counts_LE.round()).all() else counts_LE, layers)


def read_route_trace(path: Path) -> dict:
    lines = _lines(path)
    meta = read_metadata([x for x in lines if x.startswith("#")])
    try:
        num_layers, num_experts, top_k = int(meta["n_layer"]), int(meta["n_expert"]), int(meta["n_expert_used"])
    except (KeyError, ValueError):
        raise TiermoeError(f"'{path}' lacks '# ... n_layer=.. n_expert=.. n_expert_used=..': not a route_trace v1 "
                           "file") from None
    body = [x for x in lines if x.strip() and not x.startswith("#")]
    header = body[0].split(",") if body else []
    if header[:6] != ["turn", "phase", "step", "layer", "slot", "expert"]:
        raise TiermoeError(f"'{path}': expected the header 'turn,phase,step,layer,slot,expert,...'")
    token_of: dict[tuple[int, int], int] = {}
    tokens: list[tuple[int, int, bool, int]] = []
    entries = []
    for number, line in enumerate(body[1:], 2):
        try:
            turn, phase, step, layer, slot, expert = (int(x) for x in line.split(",")[:6])
        except ValueError:
            raise TiermoeError(f"'{path}' data line {number}: '{line[:60]}' is not integers") from None
        if not (0 <= layer < num_layers and 0 <= slot < top_k and 0 <= expert < num_experts):
            raise TiermoeError(f"'{path}' data line {number}: layer {layer}, slot {slot} or expert {expert} is out "
                               f"of range ({num_layers} layers, {num_experts} experts, top-{top_k})")
        key = (turn, step)
        if key not in token_of:
            token_of[key] = len(tokens)
            tokens.append((turn, step, phase == 0, len(tokens)))
        entries.append((token_of[key], layer, slot, expert))
    if not entries:
        raise TiermoeError(f"'{path}' holds no routing rows")
    layers = sorted({e[1] for e in entries})
    moe_index = {layer: m for m, layer in enumerate(layers)}
    ids_NMK = torch.full((len(tokens), len(layers), top_k), -1, dtype=torch.int64)
    for token, layer, slot, expert in entries:
        ids_NMK[token, moe_index[layer], slot] = expert
    complete = (ids_NMK >= 0).all(-1) | (ids_NMK < 0).all(-1)  # a layer is logged whole or not at all
    ids_NMK[~complete] = -1
    # prompt tokens of one turn ran as one batch
    pass_N, p, last = [], -1, None
    for seq, _, prefill, _ in tokens:
        if not (prefill and last == (seq, True)):
            p += 1
        pass_N.append(p)
        last = (seq, prefill)
    tokens = [(s, q, pf, pass_N[i]) for i, (s, q, pf, _) in enumerate(tokens)]
    model = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}.get(meta.get("arch", ""), meta.get("arch", "unknown"))
    return trace_dict(tokens, ids_NMK, layers, num_layers, num_experts, model, "route trace")


def read_sglang_per_token(data: dict, source: str) -> dict:
    records = data.get("records")
    mapping = data.get("last_physical_to_logical_map")
    if not isinstance(records, list) or not isinstance(mapping, torch.Tensor) or mapping.dim() != 2:
        raise TiermoeError(f"'{source}' is not an SGLang per_token dump (records and last_physical_to_logical_map)")
    records = sorted((r for r in records if isinstance(r, dict) and "topk_ids_of_layer" in r),
                     key=lambda r: r.get("forward_pass_id", 0))
    if not records:
        raise TiermoeError(f"'{source}' holds no per_token records (an SGLang per_pass dump has none)")
    num_layers = mapping.shape[0]
    num_experts = int(mapping.max()) + 1
    open_seqs: dict[int, deque] = defaultdict(deque)  # last position -> sequences waiting for the next token
    tokens, ids = [], []
    next_seq = 0
    for p, record in enumerate(records):
        topk = record["topk_ids_of_layer"].long()  # [L, T, 8] physical ids, -1 = none
        positions = list(record.get("positions") or [])
        if topk.dim() != 3 or topk.shape[0] != num_layers or topk.shape[1] != len(positions):
            raise TiermoeError(f"'{source}' record {p}: topk_ids_of_layer {list(topk.shape)} does not match "
                               f"{num_layers} layers x {len(positions)} positions")
        logical = torch.where(topk >= 0, mapping.long().gather(1, topk.clamp(min=0).flatten(1)).view_as(topk), -1)
        ids.append(logical.permute(1, 0, 2))  # [T, L, 8]
        lens = list(record.get("extend_seq_lens") or [])
        groups = [(n, True) for n in lens] if sum(lens) <= len(positions) else []
        groups += [(1, False)] * (len(positions) - sum(n for n, _ in groups))
        row = 0
        for n, prefill in groups:
            start = positions[row]
            waiting = open_seqs.get(start - 1)
            seq = waiting.popleft() if waiting else None
            if seq is None:
                seq, next_seq = next_seq, next_seq + 1
            for i in range(n):
                tokens.append((seq, positions[row + i], prefill, p))
            open_seqs[positions[row + n - 1]].append(seq)
            row += n
    ids_NLK = torch.cat(ids)
    used_L = (ids_NLK >= 0).any(dim=(0, 2))
    used_K = (ids_NLK >= 0).any(dim=(0, 1))
    layers = used_L.nonzero().flatten().tolist()
    if not layers:
        raise TiermoeError(f"'{source}' records route no token")
    ids_NMK = ids_NLK[:, layers][:, :, used_K]
    return trace_dict(tokens, ids_NMK, layers, num_layers, num_experts, "unknown", "sglang per_token")
