"""How good a placement is for given statistics.

hit_rate: share of routed (token, expert) pairs served by the GPU tier. The oracle for given counts is the
top-k of those same counts. cpu_bytes_per_pass: what batched decode actually pays, since a CPU expert's
weights are read once per forward pass however many of the batch's tokens route to it.
"""

from __future__ import annotations

import torch


def hit_rate(mask_LE: torch.Tensor, counts_LE: torch.Tensor) -> float:
    counts = torch.as_tensor(counts_LE, dtype=torch.float64).nan_to_num(0.0)
    total = float(counts.sum())
    return float((counts * torch.as_tensor(mask_LE).bool()).sum()) / total if total > 0 else 0.0


def layer_coverage(mask_LE: torch.Tensor, counts_LE: torch.Tensor) -> torch.Tensor:
    """[L] float64: per layer, the share of that layer's statistics mass on the GPU tier (0 for empty layers)."""
    counts = torch.as_tensor(counts_LE, dtype=torch.float64).nan_to_num(0.0)
    per_layer = counts.sum(dim=1)
    covered = (counts * torch.as_tensor(mask_LE).bool()).sum(dim=1)
    return torch.where(per_layer > 0, covered / per_layer.clamp(min=1e-300), torch.zeros_like(per_layer))


def cpu_bytes_per_pass(mask_LE: torch.Tensor, pass_counts_PLE: torch.Tensor, bytes_per_expert: int) -> float:
    """Mean over forward passes of (distinct CPU-tier experts the pass routes to) x bytes per expert."""
    touched = torch.as_tensor(pass_counts_PLE) > 0
    cpu_touched = touched & ~torch.as_tensor(mask_LE).bool()[None]
    if cpu_touched.shape[0] == 0:
        return 0.0
    return float(cpu_touched.sum(dim=(1, 2)).double().mean()) * bytes_per_expert
