"""Routing traces as plain text: a CSV with one row per (token, MoE layer), readable by anything that reads a
`per_token` trace (`tiermoe stats`, `tiermoe place --init-expert-location`, `tiermoe bench dynamic`).

    # tiermoe routing trace v1                         optional `# key=value` lines before the header:
    # num_layers=27 num_experts=64 top_k=6            num_layers, num_experts (default: largest seen + 1),
    seq,pos,layer,experts                             top_k (checked), model_type, source
    0,0,1,8 26 56 57 60 11
    0,0,2,3 12 24 34 62 63

- `seq` the request (an integer), `pos` the token's position in it (0 = first token), `layer` the model's
  0-based decoder-layer index (dense layers have no rows), `experts` the top-k ids space-separated in router order.
- Optional columns: `prefill` (1 for a prompt token, 0 for a generated one; default 0) and `pass` (the forward
  pass: rows of one pass share a batch). Without `pass`, each decode token is a pass of its own and the prompt
  tokens of one request, in a row, are one prefill pass: one request at a time, as the published traces are.
- Tokens keep the order of their first row; a token without a row for some MoE layer has -1 there.
The reader gives the same dict as a `per_token` dump (tiermoe.stats.traces), so every consumer takes either.
Legend: N tokens, M MoE layers, K top-k.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiermoe.errors import TiermoeError
from tiermoe.stats.stat_header import DUMP_FORMAT, DUMP_VERSION
from tiermoe.stats.traces import counts_from_trace, ids_dtype

TRACE_MAGIC = "# tiermoe routing trace v1"
TRACE_COLUMNS = ("seq", "pos", "layer", "experts")
OPTIONAL_COLUMNS = ("prefill", "pass")
META_INTS = ("num_layers", "num_experts", "top_k")


def read_metadata(lines: list[str]) -> dict:
    """`# key=value` pairs of the comment lines before a header (other comments are free text)."""
    meta: dict = {}
    for line in lines:
        for word in line.lstrip("#").split():
            key, eq, value = word.partition("=")
            if eq and key:
                meta[key] = value
    return meta


def _int_meta(meta: dict, key: str, source: str) -> int | None:
    if key not in meta:
        return None
    try:
        value = int(meta[key])
    except ValueError:
        value = 0
    if value < 1:
        raise TiermoeError(f"'{source}': metadata {key}={meta[key]!r} is not a positive integer")
    return value


def read_trace_csv(path: str | Path, comments: list[str], header: str, body) -> dict:
    """Parse a trace CSV (its comment lines, header line and an iterator over the remaining (number, line) pairs)
    into a per_token trace dict."""
    source = str(path)
    columns = [c.strip() for c in header.split(",")]
    unknown = [c for c in columns if c not in TRACE_COLUMNS + OPTIONAL_COLUMNS]
    missing = [c for c in TRACE_COLUMNS if c not in columns]
    if unknown or missing or len(set(columns)) != len(columns):
        raise TiermoeError(f"'{source}': trace header '{header}' must name seq,pos,layer,experts (and optionally "
                           f"prefill, pass) once each" + (f"; unknown: {','.join(unknown)}" if unknown else ""))
    col = {c: i for i, c in enumerate(columns)}
    meta = read_metadata(comments)
    top_k = _int_meta(meta, "top_k", source)
    token_of: dict[tuple[int, int], int] = {}
    tokens: list[list[int]] = []  # [seq, pos, prefill, pass]
    rows: list[tuple[int, int, list[int]]] = []  # (token, layer, ids)
    for number, line in body:
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.rstrip("\r\n").split(",")
        if len(cells) != len(columns):
            raise TiermoeError(f"'{source}' line {number}: {len(cells)} fields, the header names {len(columns)}")
        try:
            seq, pos, layer = int(cells[col["seq"]]), int(cells[col["pos"]]), int(cells[col["layer"]])
            ids = [int(x) for x in cells[col["experts"]].split()]
            prefill = int(cells[col["prefill"]]) if "prefill" in col else 0
            pass_ = int(cells[col["pass"]]) if "pass" in col else -1
        except ValueError:
            raise TiermoeError(f"'{source}' line {number}: '{line.strip()[:80]}' is not integers "
                               "(seq,pos,layer and space-separated expert ids)") from None
        if min(seq, pos, layer) < 0 or prefill not in (0, 1) or ("pass" in col and pass_ < 0):
            raise TiermoeError(f"'{source}' line {number}: seq, pos, layer and pass are >= 0 and prefill is 0 or 1")
        if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
            raise TiermoeError(f"'{source}' line {number}: experts '{cells[col['experts']]}' must be distinct "
                               "expert ids >= 0, space-separated")
        top_k = top_k or len(ids)
        if len(ids) != top_k:
            raise TiermoeError(f"'{source}' line {number}: {len(ids)} experts, expected top_k={top_k}")
        key = (seq, pos)
        token = token_of.get(key)
        if token is None:
            token = token_of[key] = len(tokens)
            tokens.append([seq, pos, prefill, pass_])
        rows.append((token, layer, ids))
    if not rows:
        raise TiermoeError(f"'{source}' holds no trace rows after its header")
    return _trace_dict(source, meta, tokens, rows, top_k, "pass" in col)


def _trace_dict(source: str, meta: dict, tokens: list, rows: list, top_k: int, has_pass: bool) -> dict:
    layers = sorted({layer for _, layer, _ in rows})
    max_id = max(max(ids) for _, _, ids in rows)
    num_layers = _int_meta(meta, "num_layers", source) or layers[-1] + 1
    num_experts = _int_meta(meta, "num_experts", source) or max_id + 1
    if layers[-1] >= num_layers or max_id >= num_experts:
        raise TiermoeError(f"'{source}': rows name layer {layers[-1]} and expert {max_id}, but the metadata says "
                           f"num_layers={num_layers}, num_experts={num_experts}")
    moe_index = {layer: m for m, layer in enumerate(layers)}
    ids_NMK = torch.full((len(tokens), len(layers), top_k), -1, dtype=ids_dtype(num_experts))
    filled = torch.zeros(len(tokens), len(layers), dtype=torch.bool)
    token_N = torch.tensor([r[0] for r in rows])
    m_N = torch.tensor([moe_index[r[1]] for r in rows])
    if bool(torch.bincount(token_N * len(layers) + m_N).gt(1).any()):
        raise TiermoeError(f"'{source}': some token (seq, pos) has two rows for one layer")
    ids_NMK[token_N, m_N] = torch.tensor([r[2] for r in rows], dtype=ids_NMK.dtype)
    filled[token_N, m_N] = True
    table = torch.tensor(tokens, dtype=torch.int64)
    prefill_N = table[:, 2].bool()
    trace = {
        "format": DUMP_FORMAT, "format_version": DUMP_VERSION, "mode": "per_token", "rank": 0,
        "model_type": meta.get("model_type", "unknown"), "num_layers": num_layers, "num_experts": num_experts,
        "top_k": top_k, "moe_layers": layers, "buffer_size": -1, "source_kind": "trace csv",
        "token_pass": (table[:, 3] if has_pass else one_request_passes(table[:, 0], prefill_N)).to(torch.int32),
        "token_request": table[:, 0].to(torch.int32), "token_position": table[:, 1].to(torch.int32),
        "token_is_prefill": prefill_N, "topk_ids": ids_NMK,
    }
    trace["logical_count"] = counts_from_trace(trace, num_layers, num_experts)[None]
    trace.update(num_passes=int(torch.unique(trace["token_pass"]).numel()), num_tokens=len(tokens),
                 num_prefill_tokens=int(prefill_N.sum()), num_decode_tokens=int((~prefill_N).sum()),
                 missing_rows=int((~filled).sum()))
    return trace


def one_request_passes(seq_N: torch.Tensor, prefill_N: torch.Tensor) -> torch.Tensor:
    """Pass of each token when requests ran one at a time: a run of prompt tokens of one request is one pass,
    every other token a pass of its own."""
    n = seq_N.numel()
    same_run = torch.zeros(n, dtype=torch.bool)
    if n > 1:
        same_run[1:] = prefill_N[1:] & prefill_N[:-1] & (seq_N[1:] == seq_N[:-1])
    return torch.cumsum((~same_run).long(), 0) - 1


def write_trace_csv(trace: dict, path: str | Path, source: str | None = None) -> Path:
    """Write a per_token trace dict (a tiermoe dump, or what a converter built) as a trace CSV; the `pass` column
    is written only when the passes differ from one request at a time."""
    ids_NMK = trace["topk_ids"].long()
    n, m, k = ids_NMK.shape
    layers = [int(x) for x in trace["moe_layers"]]
    seq_N, pos_N = trace["token_request"].long(), trace["token_position"].long()
    prefill_N = trace["token_is_prefill"].bool()
    pass_N = torch.unique(trace["token_pass"].long(), return_inverse=True)[1]
    with_pass = not torch.equal(pass_N, one_request_passes(seq_N, prefill_N))
    path = Path(path)
    meta = [f"num_layers={int(trace['num_layers'])}", f"num_experts={int(trace['num_experts'])}", f"top_k={k}"]
    if trace.get("model_type") not in (None, "unknown"):
        meta.append(f"model_type={trace['model_type']}")
    header = "seq,pos,layer,experts,prefill" + (",pass" if with_pass else "")
    try:
        with path.open("w") as out:
            out.write(f"{TRACE_MAGIC}\n# {' '.join(meta)}\n")
            if source:
                out.write(f"# source: {source}\n")
            out.write(header + "\n")
            ids = ids_NMK.tolist()
            seqs, poss, pre, pas = seq_N.tolist(), pos_N.tolist(), prefill_N.tolist(), pass_N.tolist()
            for t in range(n):
                tail = f",{int(pre[t])}" + (f",{pas[t]}" if with_pass else "")
                for j in range(m):
                    row = [x for x in ids[t][j] if x >= 0]
                    if len(row) == k:  # a layer the token has no routing for has no row
                        out.write(f"{seqs[t]},{poss[t]},{layers[j]},{' '.join(map(str, row))}{tail}\n")
    except OSError as err:
        raise TiermoeError(f"cannot write trace to '{path}': {err.strerror or err}") from None
    return path
