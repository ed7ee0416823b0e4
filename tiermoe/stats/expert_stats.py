"""ExpertStats: activation statistics as one table, whichever tool wrote the file, and merging several.

Recognised contents (dicts as torch.load(weights_only=True) returns them):
- tiermoe dumps (`format` == "tiermoe-expert-distribution"), any mode: counts, metadata, and the prefill/decode
  split (exact for stat and per_token; for per_pass, from the passes that were wholly prefill or decode);
- SGLang's stat dump `expert_distribution_recorder_{time}.pt`: `logical_count` [buf, num_hidden_layers, E];
- SGLang's per_pass / per_token dumps (`records`), SGLang's or tiermoe's, via tiermoe.stats.sglang_records;
- KTransformers' `activation_stats.pt`: `logical_count` [1, L, E] and `activation_counts` [L, E];
- a bare tensor [L, E] or [buf, L, E].
Counts are summed over the first (buffer) axis and held as float64 [L, E]. Without metadata, the MoE layers are
the rows with any count (SGLang leaves dense layers' rows zero).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tiermoe.errors import TiermoeError
from tiermoe.stats.sglang_records import from_records, is_records_file
from tiermoe.stats.stat_header import DUMP_FORMAT
from tiermoe.stats.traces import counts_from_trace


@dataclass(frozen=True)
class ExpertStats:
    counts_LE: torch.Tensor  # float64 [L, E], routed (token, expert) pairs per layer and expert
    moe_layers: tuple[int, ...]
    prefill_LE: torch.Tensor | None = None  # float64 [L, E] of prefill rows, when the file has the split
    decode_LE: torch.Tensor | None = None
    num_prefill_tokens: int | None = None
    num_decode_tokens: int | None = None
    top_k: int | None = None
    model_type: str | None = None
    sources: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()  # per source: "tiermoe stat", "sglang stat", "ktransformers", "tensor", ...
    notes: tuple[str, ...] = ()
    gpu_masks_PLE: torch.Tensor | None = field(default=None, repr=False)  # bool GPU-tier snapshots, if recorded

    @property
    def num_layers(self) -> int:
        return self.counts_LE.shape[0]

    @property
    def num_experts(self) -> int:
        return self.counts_LE.shape[1]

    @property
    def moe_rows_L(self) -> torch.Tensor:
        rows = torch.zeros(self.num_layers, dtype=torch.bool)
        rows[list(self.moe_layers)] = True
        return rows

    @property
    def has_split(self) -> bool:
        return self.prefill_LE is not None and self.decode_LE is not None


def stats_from_data(data, source: str) -> ExpertStats:
    """Parse what torch.load returned for one statistics file (see the module docstring)."""
    if isinstance(data, torch.Tensor):
        return _plain(_as_counts(data, source), source, "tensor")
    if is_records_file(data):
        data = from_records(data, source)
    if not isinstance(data, dict):
        raise TiermoeError(f"'{source}' holds a {type(data).__name__}; expected a dict with 'logical_count' "
                           "(SGLang / tiermoe) or 'activation_counts' (KTransformers), or a tensor")
    if data.get("format") == DUMP_FORMAT:
        return _tiermoe(data, source)
    if isinstance(data.get("logical_count"), torch.Tensor):
        kind = "ktransformers activation_stats" if "activation_counts" in data else data.get("source_kind",
                                                                                                "sglang stat")
        return _plain(_as_counts(data["logical_count"], source), source, kind)
    if isinstance(data.get("activation_counts"), torch.Tensor):
        return _plain(_as_counts(data["activation_counts"], source), source, "ktransformers activation_stats")
    if "gpu_expert_masks" in data:
        raise TiermoeError(f"'{source}' holds GPU-tier snapshots only (gpu_expert_masks), no activation counts")
    keys = ", ".join(map(str, list(data)[:8]))
    raise TiermoeError(f"'{source}' is a dict without 'logical_count' or 'activation_counts' (keys: {keys})")


def check_counts(t: torch.Tensor, source: str, name: str = "counts") -> None:
    """Counts are routed-token tallies: finite and >= 0. NaN, infinity or a negative count is a corrupted (or
    hand-made) file, and any of them would make every share and hit rate computed from it meaningless."""
    if not isinstance(t, torch.Tensor) or t.is_complex() or t.dtype == torch.bool:
        kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TiermoeError(f"'{source}' {name} have dtype {kind}; expected integers or floats")
    if t.is_floating_point():
        for bad, what in ((torch.isnan(t), "NaN"), (torch.isinf(t), "infinite")):
            if bool(bad.any()):
                where = bad.nonzero()[0].tolist()
                raise TiermoeError(f"'{source}' holds {what} {name} (first at index {where}); activation counts are "
                                   "finite numbers >= 0")
    negative = t < 0
    if bool(negative.any()):
        where = negative.nonzero()[0].tolist()
        raise TiermoeError(f"'{source}' holds negative {name} ({t[tuple(where)].item():g} at index {where}); "
                           "activation counts are >= 0")


def _as_counts(t: torch.Tensor, source: str, name: str = "counts") -> torch.Tensor:
    check_counts(t, source, name)
    if t.dim() == 3:
        t = t.sum(dim=0)
    elif t.dim() != 2:
        raise TiermoeError(f"'{source}' holds counts of shape {list(t.shape)}; expected [buf, layers, experts] "
                           "or [layers, experts]")
    return t.to("cpu", torch.float64)


def _plain(counts_LE: torch.Tensor, source: str, kind: str) -> ExpertStats:
    moe = tuple((counts_LE != 0).any(dim=1).nonzero().flatten().tolist())
    return ExpertStats(counts_LE, moe, sources=(source,), kinds=(kind,))


def _tiermoe(data: dict, source: str) -> ExpertStats:
    counts_LE = _as_counts(data["logical_count"], source)
    L, E = counts_LE.shape
    if (L, E) != (data.get("num_layers"), data.get("num_experts")):
        raise TiermoeError(f"'{source}' is inconsistent: logical_count is [buf, {L}, {E}] but its metadata says "
                           f"{data.get('num_layers')} layers x {data.get('num_experts')} experts")
    mode = data.get("mode", "stat")
    prefill = decode = None
    notes: tuple[str, ...] = ()
    n_prefill, n_decode = data.get("num_prefill_tokens"), data.get("num_decode_tokens")
    if "logical_count_prefill" in data:
        prefill = _as_counts(data["logical_count_prefill"], source, "prefill counts")
        decode = _as_counts(data.get("logical_count_decode"), source, "decode counts")
        if prefill.shape != (L, E) or decode.shape != (L, E):
            raise TiermoeError(f"'{source}' is inconsistent: its prefill/decode counts are not [{L}, {E}]")
    elif mode == "per_token":
        select = data["token_is_prefill"]
        prefill = counts_from_trace(data, L, E, select).double()
        decode = counts_from_trace(data, L, E, ~select).double()
    elif mode == "per_pass":
        pure_prefill = data["num_decode_tokens"] == 0
        pure_decode = data["num_prefill_tokens"] == 0
        per_pass = data["logical_count"].double()
        prefill, decode = per_pass[pure_prefill].sum(dim=0), per_pass[pure_decode].sum(dim=0)
        n_prefill, n_decode = int(data["num_prefill_tokens"][pure_prefill].sum()), int(
            data["num_decode_tokens"][pure_decode].sum())
        mixed = int((~pure_prefill & ~pure_decode).sum())
        if mixed:
            notes = (f"{source}: prefill/decode split from the pure passes; {mixed} passes mixing both left out",)
    masks = data.get("gpu_expert_masks")
    kind = data.get("source_kind") or f"tiermoe {mode}"  # the text formats say which they were
    return ExpertStats(counts_LE, tuple(data.get("moe_layers") or ()), prefill, decode,
                       None if n_prefill is None else int(n_prefill), None if n_decode is None else int(n_decode),
                       data.get("top_k"), data.get("model_type"), (source,), (kind,), notes,
                       masks if isinstance(masks, torch.Tensor) else None)


def check_shape(stats: ExpertStats, num_layers: int | None, num_experts: int | None, model: str = "this model"
                ) -> None:
    """One clear error when statistics come from a model with other layer or expert counts."""
    expected = (num_layers or stats.num_layers, num_experts or stats.num_experts)
    if (stats.num_layers, stats.num_experts) != expected:
        raise TiermoeError(f"'{stats.sources[0]}' holds statistics of shape [buf, {stats.num_layers}, "
                           f"{stats.num_experts}] (layers x experts); {model} expects [buf, {expected[0]}, "
                           f"{expected[1]}] (num_hidden_layers x experts): it was recorded on another model")


def merge(parts: list[ExpertStats]) -> ExpertStats:
    """Sum statistics of one model from several files (shapes must agree; the split is kept if all have it)."""
    if not parts:
        raise TiermoeError("no statistics files given")
    first = parts[0]
    for other in parts[1:]:
        check_shape(other, first.num_layers, first.num_experts, model=f"'{first.sources[0]}'")
    if len(parts) == 1:
        return first
    split = all(p.has_split for p in parts)
    notes = tuple(n for p in parts for n in p.notes)
    if not split and any(p.has_split for p in parts):
        notes += ("prefill/decode split left out: not every file has it",)
    top_ks = {p.top_k for p in parts if p.top_k is not None}
    types = {p.model_type for p in parts if p.model_type}
    if len(types) > 1:
        notes += (f"merged files name different model types: {', '.join(sorted(types))}",)
    total = lambda name: (sum(getattr(p, name) for p in parts)  # noqa: E731
                          if all(getattr(p, name) is not None for p in parts) else None)
    return replace(
        first,
        counts_LE=sum(p.counts_LE for p in parts),
        moe_layers=tuple(sorted(set().union(*(p.moe_layers for p in parts)))),
        prefill_LE=sum(p.prefill_LE for p in parts) if split else None,
        decode_LE=sum(p.decode_LE for p in parts) if split else None,
        num_prefill_tokens=total("num_prefill_tokens"), num_decode_tokens=total("num_decode_tokens"),
        top_k=top_ks.pop() if len(top_ks) == 1 else None,
        sources=tuple(s for p in parts for s in p.sources), kinds=tuple(k for p in parts for k in p.kinds),
        notes=notes, gpu_masks_PLE=None,
    )
