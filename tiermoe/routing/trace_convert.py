"""`tiermoe trace convert`: routing from another tool's layout (tiermoe.routing.trace_import) to tiermoe's text
formats: a per-token trace becomes a trace CSV, counts become a heat-matrix CSV (docs/traces.md).

The layout is detected from the content when not given: a `.pt` with `records` is SGLang's per_token dump, any
other `.pt` a tiermoe statistics file; text with `ALPH=` is an ESFT trace, `turn,phase,step,...` a route trace,
`layer,e0,...` a heat matrix, `seq,pos,layer,experts` already a trace CSV, bare rows of numbers ESFT counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tiermoe.errors import TiermoeError
from tiermoe.routing.trace_import import (
    LAYOUTS,
    read_esft_counts,
    read_esft_trace,
    read_route_trace,
    read_sglang_per_token,
)
from tiermoe.stats.heat_csv import write_heat_csv
from tiermoe.stats.text_files import is_text_file, read_text_statistics
from tiermoe.stats.trace_csv import one_request_passes, write_trace_csv


@dataclass(frozen=True)
class Converted:
    path: Path
    kind: str  # "trace" or "heat"
    layout: str
    num_layers: int
    num_experts: int
    tokens: int | None  # tokens of a trace
    missing_rows: int = 0  # (token, MoE layer) pairs the source did not log

    def describe(self) -> str:
        what = (f"trace of {self.tokens} tokens" if self.kind == "trace" else "heat matrix")
        gaps = f"; {self.missing_rows} (token, layer) rows missing in the source" if self.missing_rows else ""
        return (f"wrote {self.path}: {what}, {self.num_layers} layers x {self.num_experts} experts "
                f"(from {self.layout}){gaps}")


def detect_layout(path: Path) -> str:
    if not path.is_file():
        raise TiermoeError(f"'{path}' does not exist")
    if not is_text_file(path):
        data = _torch_load(path)
        return "sglang" if isinstance(data, dict) and "records" in data else "tiermoe"
    comments, first = "", ""
    with path.open(encoding="utf-8", errors="replace") as f:
        for _, line in zip(range(10_000), f):  # comment lines, then the first line of data or header
            if line.startswith("#"):
                comments += line
            elif line.strip():
                first = line.strip()
                break
    if "ALPH=" in comments:
        return "esft-trace"
    if first.startswith("turn,phase,step,layer"):
        return "route-trace"
    if first.startswith("layer,"):
        return "heat"
    if first.startswith("seq,"):
        return "tiermoe"
    if first and all(c.isdigit() or c in ",. " for c in first):
        return "esft-counts"
    raise TiermoeError(f"cannot tell the layout of '{path}' (first line '{first[:60]}'); name it with --from "
                       f"({', '.join(LAYOUTS)})")


def _torch_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure is a bad file for the user
        raise TiermoeError(f"'{path}' is not a .pt file torch loads safely ({type(err).__name__})") from None


def read_routing(path: Path, layout: str, first_moe_layer: int = 1) -> dict:
    """The routing of `path` in `layout` as a per_token trace dict or a `stat` dict (logical_count)."""
    if layout == "esft-trace":
        return read_esft_trace(path, first_moe_layer)
    if layout == "esft-counts":
        return read_esft_counts(path, first_moe_layer)
    if layout == "route-trace":
        return read_route_trace(path)
    if layout == "sglang":
        return read_sglang_per_token(_torch_load(path), str(path))
    if layout in ("heat", "tiermoe"):
        return read_text_statistics(path) if is_text_file(path) else _torch_load(path)
    raise TiermoeError(f"unknown layout '{layout}'; choose one of: {', '.join(LAYOUTS)}")


def with_prompts(trace: dict, share: float) -> dict:
    """`trace` with the first ceil(share x length) positions of every request marked as its prompt (the rest its
    answer), requests one at a time: for traces that mark no prompt, such as ESFT's teacher-forced text, so that
    prefill-time placement (KT's layerwise prefill, adaptive's prompt evidence) has prompts to act on."""
    seq_N, pos_N = trace["token_request"].long(), trace["token_position"].long()
    length_N = torch.zeros(int(seq_N.max()) + 1, dtype=torch.long).scatter_reduce(
        0, seq_N, pos_N + 1, reduce="amax")[seq_N]
    prefill_N = pos_N < torch.ceil(share * length_N.double()).long()
    prompts = int(prefill_N.sum())
    return {**trace, "token_is_prefill": prefill_N, "token_pass": one_request_passes(seq_N, prefill_N),
            "num_prefill_tokens": prompts, "num_decode_tokens": int(seq_N.numel()) - prompts}


def convert(src: str | Path, dst: str | Path, layout: str | None = None, first_moe_layer: int = 1,
            prompt_share: float | None = None) -> Converted:
    """Convert `src` (layout detected when None) to a trace CSV or heat CSV at `dst`; `prompt_share`: mark that
    share of each request as its prompt (`with_prompts`; a trace only)."""
    src = Path(src)
    layout = layout or detect_layout(src)
    data = read_routing(src, layout, first_moe_layer)
    if isinstance(data, dict) and data.get("mode") == "per_token" and "topk_ids" in data:
        if prompt_share is not None:
            data = with_prompts(data, prompt_share)
        write_trace_csv(data, dst, source=f"{src.name} ({layout})" + (
            f", the first {prompt_share:g} of each request marked as its prompt" if prompt_share is not None else ""))
        ids = data["topk_ids"]
        missing = int((ids < 0).all(-1).sum())
        return Converted(Path(dst), "trace", layout, int(data["num_layers"]), int(data["num_experts"]),
                         ids.shape[0], missing)
    if prompt_share is not None:
        raise TiermoeError(f"--prompt-share marks prompts in a per-token trace; '{src}' holds counts ({layout})")
    counts = _counts_LE(data, src)
    moe = data.get("moe_layers") if isinstance(data, dict) else None
    write_heat_csv(counts, dst, moe or None, source=f"{src.name} ({layout})",
                   top_k=data.get("top_k") if isinstance(data, dict) else None,
                   model_type=(data.get("model_type") if isinstance(data, dict)
                               and data.get("model_type") != "unknown" else None))
    return Converted(Path(dst), "heat", layout, counts.shape[0], counts.shape[1], None)


def _counts_LE(data, src: Path) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        counts = data
    elif isinstance(data, dict):
        counts = next((data[k] for k in ("logical_count", "activation_counts") if isinstance(data.get(k),
                                                                                            torch.Tensor)), None)
        if counts is None:
            raise TiermoeError(f"'{src}' holds neither a per_token trace nor counts (logical_count)")
    else:
        raise TiermoeError(f"'{src}' holds a {type(data).__name__}, not routing")
    if counts.dim() == 3:
        counts = counts.sum(0)
    if counts.dim() != 2:
        raise TiermoeError(f"'{src}' holds counts of shape {list(counts.shape)}; expected [buf, L, E] or [L, E]")
    return counts
