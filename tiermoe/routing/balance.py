"""Summaries of how evenly a MoE layer spreads tokens over its experts.

All functions take `counts_E`: a 1-D tensor of per-expert routed-token counts for one layer
(E experts; integer or float, non-negative), and return a Python float. Pure functions: no state,
no model needed, so `tiermoe stats` and the demo model card can share them.

Reference points: a perfectly balanced layer has Gini 0, top-20% share 0.2 and max/min ratio 1;
published activation statistics of real MoE models (Mixtral, Qwen-MoE, DeepSeek) show per-layer
Gini of roughly 0.1-0.25.
"""

from __future__ import annotations

import math

import torch


def _as_counts(counts_E: torch.Tensor) -> torch.Tensor:
    """Validate and convert per-expert counts to float64 [E]."""
    counts_E = torch.as_tensor(counts_E)
    if counts_E.dim() != 1 or counts_E.numel() == 0:
        raise ValueError(f"counts_E must be a non-empty 1-D tensor [E], got shape {tuple(counts_E.shape)}")
    counts_E = counts_E.detach().to("cpu", torch.float64)
    if bool((counts_E < 0).any()):
        raise ValueError("counts_E must be non-negative")
    return counts_E


def gini(counts_E: torch.Tensor) -> float:
    """Gini coefficient of per-expert counts of one layer.

    Args:
        counts_E: [E] non-negative counts (tokens routed to each expert).

    Returns:
        G in [0, (E-1)/E]: 0 when every expert gets the same count, (E-1)/E when one expert gets
        everything. Computed as sum_i (2i - E - 1) x_(i) / (E * sum x) over the sorted counts
        x_(1) <= ... <= x_(E). All-zero counts give 0.0.
    """
    x_E = torch.sort(_as_counts(counts_E)).values
    total = float(x_E.sum())
    if total == 0.0:
        return 0.0
    E = x_E.numel()
    rank_E = torch.arange(1, E + 1, dtype=torch.float64)
    return float(((2 * rank_E - E - 1) * x_E).sum() / (E * total))


def top_share(counts_E: torch.Tensor, fraction: float = 0.2) -> float:
    """Share of routed tokens served by the busiest `ceil(fraction * E)` experts of one layer.

    Args:
        counts_E: [E] non-negative counts.
        fraction: in (0, 1]; e.g. 0.2 for "top-20% of experts".

    Returns:
        A share in [0, 1] (balanced routing gives about `ceil(fraction*E)/E`). All-zero counts give 0.0.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    x_E = _as_counts(counts_E)
    total = float(x_E.sum())
    if total == 0.0:
        return 0.0
    k = max(1, math.ceil(fraction * x_E.numel() - 1e-9))
    return float(torch.topk(x_E, k).values.sum() / total)


def max_min_ratio(counts_E: torch.Tensor) -> float:
    """Busiest expert's count divided by the least busy one's (inf if some expert got nothing)."""
    x_E = _as_counts(counts_E)
    lo, hi = float(x_E.min()), float(x_E.max())
    if lo == 0.0:
        return math.inf if hi > 0.0 else 1.0
    return hi / lo
