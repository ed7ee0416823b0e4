"""Describing a plan: a per-layer table, and a heatmap of layers x experts."""

from __future__ import annotations

from tiermoe.placement.metrics import hit_rate, layer_coverage
from tiermoe.placement.plan import PlacementPlan


def _size(n: float) -> str:
    """Bytes in the decimal unit that fits (a 590 KB expert reads '590.00 KB', not '0.00 GB')."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def plan_rows(plan: PlacementPlan, moe_layers, counts=None, bytes_per_expert: int | None = None) -> list[dict]:
    coverage = layer_coverage(plan.mask, counts) if counts is not None else None
    rows = []
    for layer in range(plan.num_layers):
        row = {"layer": layer, "moe": layer in moe_layers, "gpu_experts": int(plan.mask[layer].sum())}
        if plan.num_gpus > 1:
            row["per_gpu"] = [int((plan.assignment[layer] == r).sum()) for r in range(plan.num_gpus)]
        if coverage is not None:
            row["stats_share_on_gpu"] = float(coverage[layer])
        if bytes_per_expert is not None:
            row["gpu_bytes"] = row["gpu_experts"] * bytes_per_expert
        rows.append(row)
    return rows


def format_plan(plan: PlacementPlan, moe_layers, counts=None, bytes_per_expert: int | None = None) -> str:
    rows = plan_rows(plan, moe_layers, counts, bytes_per_expert)
    header = f"{'layer':>5}  {'kind':<5}  {'GPU experts':>11}"
    if plan.num_gpus > 1:
        header += f"  {'per GPU':<16}"
    if counts is not None:
        header += f"  {'stats on GPU':>12}"
    if bytes_per_expert is not None:
        header += f"  {'GPU bytes':>10}"
    lines = [header]
    for r in rows:
        line = f"{r['layer']:>5}  {'MoE' if r['moe'] else 'dense':<5}  {r['gpu_experts']:>4} / {plan.num_experts:<4}"
        if plan.num_gpus > 1:
            line += f"  {'/'.join(map(str, r['per_gpu'])):<16}"
        if counts is not None:
            line += f"  {100 * r['stats_share_on_gpu']:>11.1f}%"
        if bytes_per_expert is not None:
            line += f"  {_size(r['gpu_bytes']):>10}"
        lines.append(line)
    total = int(plan.mask.sum())
    lines.append(f"total GPU experts: {total} of {len(moe_layers) * plan.num_experts} routed experts "
                 f"({100 * total / max(1, len(moe_layers) * plan.num_experts):.1f}%), strategy {plan.strategy}")
    if bytes_per_expert is not None:
        lines.append(f"GPU-tier expert bytes: {_size(total * bytes_per_expert)}")
    if counts is not None:
        lines.append(f"expected GPU hit rate (on these statistics): {100 * hit_rate(plan.mask, counts):.1f}%")
    return "\n".join(lines)
