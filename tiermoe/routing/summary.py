"""What `tiermoe stats` reports about an ExpertStats: per-layer skew, dead experts, prefill vs decode, and (when
the caller computed them: tiermoe.analysis.strategy_sweep runs the placement strategies, which statistics do not)
the hit rate each placement strategy would get. Pure functions: statistics in, a plain dict (the --json output)
out; `format_report` turns that dict into text.

Per MoE layer: routed pairs, Gini coefficient, share of the layer's routed pairs served by its busiest 10% and
20% of experts, dead experts (never routed to), and with a prefill/decode split the Gini of each phase and the
total variation distance between the two distributions (0: same routing mix, 1: disjoint experts).
"""

from __future__ import annotations

import torch

from tiermoe.routing.balance import gini, top_share
from tiermoe.stats.expert_stats import ExpertStats


def total_variation(a_E: torch.Tensor, b_E: torch.Tensor) -> float:
    """0.5 x sum |p - q| of the two count vectors normalised to distributions (0.0 if either is empty)."""
    sa, sb = float(a_E.sum()), float(b_E.sum())
    if sa == 0 or sb == 0:
        return 0.0
    return 0.5 * float((a_E / sa - b_E / sb).abs().sum())


def layer_rows(stats: ExpertStats) -> list[dict]:
    rows = []
    for layer in stats.moe_layers:
        counts_E = stats.counts_LE[layer]
        row = {"layer": layer, "routed": float(counts_E.sum()), "gini": gini(counts_E),
               "top10_share": top_share(counts_E, 0.1), "top20_share": top_share(counts_E, 0.2),
               "dead_experts": int((counts_E == 0).sum())}
        if stats.has_split:
            prefill_E, decode_E = stats.prefill_LE[layer], stats.decode_LE[layer]
            row.update(prefill_gini=gini(prefill_E), decode_gini=gini(decode_E),
                       prefill_decode_tv=total_variation(prefill_E, decode_E))
        rows.append(row)
    return rows


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


def snapshot_check(masks_PLE: torch.Tensor, plan_mask_LE: torch.Tensor) -> dict:
    """Compare recorded GPU-tier snapshots with a plan's mask: how many passes match, the first that does not."""
    differ_PL = (masks_PLE != plan_mask_LE.bool()[None]).any(dim=2)
    bad = differ_PL.any(dim=1).nonzero().flatten().tolist()
    out = {"passes": int(masks_PLE.shape[0]), "matching": int(masks_PLE.shape[0]) - len(bad)}
    if bad:
        layer = int(differ_PL[bad[0]].nonzero()[0])
        out["first_mismatch"] = {"pass": bad[0], "layer": layer,
                                 "recorded_gpu_experts": masks_PLE[bad[0], layer].nonzero().flatten().tolist(),
                                 "planned_gpu_experts": plan_mask_LE[layer].nonzero().flatten().tolist()}
    return out


def report(stats: ExpertStats, plan_mask_LE: torch.Tensor | None = None, hit_rates: dict | None = None) -> dict:
    """Everything `tiermoe stats` shows, as plain values (the --json output). hit_rates: the strategies' expected
    hit rates (tiermoe.analysis.strategy_sweep.strategy_hit_rate_report), shown when given."""
    rows = layer_rows(stats)
    M = len(stats.moe_layers)
    out = {
        "sources": list(stats.sources), "kinds": list(stats.kinds), "model_type": stats.model_type,
        "num_layers": stats.num_layers, "num_experts": stats.num_experts, "top_k": stats.top_k,
        "moe_layers": list(stats.moe_layers), "routed": float(stats.counts_LE.sum()),
        "num_prefill_tokens": stats.num_prefill_tokens, "num_decode_tokens": stats.num_decode_tokens,
        "layers": rows,
        "mean": {key: _mean(rows, key) for key in ("gini", "top10_share", "top20_share", "prefill_gini",
                                                     "decode_gini", "prefill_decode_tv")},
        "dead_experts": sum(r["dead_experts"] for r in rows),
        "notes": list(stats.notes),
    }
    tokens = (stats.num_prefill_tokens or 0) + (stats.num_decode_tokens or 0)
    if stats.top_k and tokens and M:
        out["routed_per_token_per_layer"] = out["routed"] / (tokens * M)
    if hit_rates is not None:
        out["hit_rates"] = hit_rates
    if stats.gpu_masks_PLE is not None:
        masks = stats.gpu_masks_PLE
        out["gpu_masks"] = {"passes": int(masks.shape[0]),
                            "distinct_masks": len({tuple(m.flatten().tolist()) for m in masks}),
                            "gpu_experts_per_pass": sorted({int(m.sum()) for m in masks})}
        if plan_mask_LE is not None:
            out["gpu_masks"]["plan_check"] = snapshot_check(masks, plan_mask_LE)
    return out


def _pct(x: float | None) -> str:
    return "   -  " if x is None else f"{100 * x:5.1f}%"


def format_report(r: dict) -> str:
    lines = [f"statistics: {', '.join(r['sources'])} ({', '.join(r['kinds'])})",
             f"model: {r['model_type'] or 'unknown'}, {r['num_layers']} layers ({len(r['moe_layers'])} MoE), "
             f"{r['num_experts']} experts, top-k {r['top_k'] or '?'}; routed (token, expert) pairs {r['routed']:,.0f}"]
    if r["num_prefill_tokens"] is not None:
        lines.append(f"tokens: {r['num_prefill_tokens']:,} prefill + {r['num_decode_tokens']:,} decode")
    split = r["mean"]["prefill_decode_tv"] is not None
    header = f"{'layer':>5}  {'routed':>10}  {'gini':>5}  {'top10%':>6}  {'top20%':>6}  {'dead':>4}"
    if split:
        header += f"  {'gini prefill':>12}  {'gini decode':>11}  {'TV prefill/decode':>17}"
    lines += ["", header]
    for row in r["layers"]:
        line = (f"{row['layer']:>5}  {row['routed']:>10,.0f}  {row['gini']:5.3f}  {_pct(row['top10_share'])}  "
                f"{_pct(row['top20_share'])}  {row['dead_experts']:>4}")
        if split:
            line += f"  {row['prefill_gini']:12.3f}  {row['decode_gini']:11.3f}  {row['prefill_decode_tv']:17.3f}"
        lines.append(line)
    m = r["mean"]
    line = f"{'mean':>5}  {'':>10}  {m['gini']:5.3f}  {_pct(m['top10_share'])}  {_pct(m['top20_share'])}  " \
           f"{r['dead_experts']:>4}" if m["gini"] is not None else "no MoE layer has counts"
    if split and m["gini"] is not None:
        line += f"  {m['prefill_gini']:12.3f}  {m['decode_gini']:11.3f}  {m['prefill_decode_tv']:17.3f}"
    lines.append(line)
    if "hit_rates" in r:
        lines += _hit_rate_lines(r["hit_rates"])
    if "gpu_masks" in r:
        g = r["gpu_masks"]
        lines += ["", f"GPU-tier snapshots: {g['passes']} passes, {g['distinct_masks']} distinct masks, "
                      f"GPU experts per pass {g['gpu_experts_per_pass']}"]
        check = g.get("plan_check")
        if check:
            lines.append(f"plan check: {check['matching']} of {check['passes']} passes match the plan"
                         + (f"; first mismatch {check['first_mismatch']}" if "first_mismatch" in check else ""))
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def _hit_rate_lines(hits: dict) -> list[str]:
    where = hits["evaluated_on"] if isinstance(hits["evaluated_on"], str) else ", ".join(hits["evaluated_on"])
    lines = ["", "expected GPU hit rate by share of routed experts on the GPU tier",
             f"(placements from these statistics, hit rates measured on {where}):",
             f"{'strategy':<14}" + "".join(f"{int(100 * x):>7}%" for x in hits["ratios"])]
    for name, rates in hits["strategies"].items():
        lines.append(f"{name:<14}" + "".join(f"{100 * v:>7.1f}%" for v in rates))
    return lines
