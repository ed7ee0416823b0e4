"""Heat matrices as plain text: routed-token counts [layers x experts] in a CSV, a statistics file like SGLang's
`logical_count` (for `tiermoe stats`, `tiermoe place --init-expert-location`, `bench dynamic --calibration`).

    # num_layers=27                       optional `# key=value` lines (num_layers: default largest layer + 1;
    layer,e0,e1,...,e63                   top_k, model_type); then the header: `layer` and one column per expert
    1,496,589,871,...                     one row per MoE layer: its 0-based decoder-layer index, then the counts

Counts are numbers >= 0 (token counts, or any activation weights); layers without a row (dense layers) are zero.
The reader gives the dict a tiermoe `stat` dump holds, so every consumer takes either.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiermoe.errors import TiermoeError
from tiermoe.stats.expert_stats import check_counts
from tiermoe.stats.stat_header import DUMP_FORMAT, DUMP_VERSION
from tiermoe.stats.trace_csv import read_metadata


def heat_header(num_experts: int) -> str:
    return "layer," + ",".join(f"e{e}" for e in range(num_experts))


def read_heat_csv(path: str | Path, comments: list[str], header: str, body) -> dict:
    """Parse a heat CSV (comment lines, header, iterator over (number, line)) into a `stat` dump dict."""
    source = str(path)
    columns = [c.strip() for c in header.split(",")]
    num_experts = len(columns) - 1
    if num_experts < 1 or columns != heat_header(num_experts).split(","):
        raise TiermoeError(f"'{source}': a heat matrix header is 'layer,e0,e1,...,e<E-1>' (experts in order), "
                           f"found '{header[:80]}'")
    rows: dict[int, list[float]] = {}
    for number, line in body:
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.rstrip("\r\n").split(",")
        if len(cells) != num_experts + 1:
            raise TiermoeError(f"'{source}' line {number}: {len(cells) - 1} counts, the header names {num_experts} "
                               "experts")
        try:
            layer, counts = int(cells[0]), [float(x) for x in cells[1:]]
        except ValueError:
            raise TiermoeError(f"'{source}' line {number}: '{line.strip()[:60]}...' is not a layer index and "
                               "numbers") from None
        if layer < 0 or layer in rows:
            raise TiermoeError(f"'{source}' line {number}: layer {layer} is negative or appears twice")
        rows[layer] = counts
    if not rows:
        raise TiermoeError(f"'{source}' holds no rows after its header")
    meta = read_metadata(comments)
    num_layers = max(rows) + 1
    if "num_layers" in meta:
        try:
            num_layers = int(meta["num_layers"])
        except ValueError:
            num_layers = 0
        if num_layers <= max(rows):
            raise TiermoeError(f"'{source}': metadata num_layers={meta['num_layers']} but a row names layer "
                               f"{max(rows)}")
    counts_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)
    for layer, counts in rows.items():
        counts_LE[layer] = torch.tensor(counts, dtype=torch.float64)
    check_counts(counts_LE, source)
    if counts_LE.eq(counts_LE.round()).all():
        counts_LE = counts_LE.long()
    top_k = int(meta["top_k"]) if meta.get("top_k", "").isdigit() else None
    return {"format": DUMP_FORMAT, "format_version": DUMP_VERSION, "mode": "stat", "rank": 0,
            "model_type": meta.get("model_type", "unknown"), "num_layers": num_layers, "num_experts": num_experts,
            "top_k": top_k, "moe_layers": sorted(rows), "buffer_size": -1, "source_kind": "heat csv",
            "logical_count": counts_LE[None]}


def write_heat_csv(counts_LE: torch.Tensor, path: str | Path, moe_layers=None, source: str | None = None,
                   top_k: int | None = None, model_type: str | None = None) -> Path:
    """Write counts [L, E] (rows of `moe_layers`; default: the rows with any count) as a heat CSV."""
    counts_LE = counts_LE.detach().cpu()
    layers = list(moe_layers) if moe_layers is not None else (counts_LE != 0).any(1).nonzero().flatten().tolist()
    meta = [f"num_layers={counts_LE.shape[0]}"] + ([f"top_k={top_k}"] if top_k else []) + (
        [f"model_type={model_type}"] if model_type else [])
    integral = bool(counts_LE.eq(counts_LE.round()).all())
    path = Path(path)
    try:
        with path.open("w") as out:
            out.write(f"# tiermoe heat matrix v1\n# {' '.join(meta)}\n")
            if source:
                out.write(f"# source: {source}\n")
            out.write(heat_header(counts_LE.shape[1]) + "\n")
            for layer in layers:
                row = counts_LE[layer].tolist()
                cells = [str(int(x)) if integral else f"{x:.6g}" for x in row]
                out.write(f"{layer}," + ",".join(cells) + "\n")
    except OSError as err:
        raise TiermoeError(f"cannot write heat matrix to '{path}': {err.strerror or err}") from None
    return path
