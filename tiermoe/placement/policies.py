"""Placement policies: the swap they propose and KTransformers' dynamic update (tiermoe's adaptive policy is in
adaptive_policy.py, the expert caches in cache_policies.py; "static" is no policy at all).

A policy sees per-pass routing counts and proposes swaps; it never touches weights. The same objects drive the
live engine (engine/placement_manager.py, with asynchronous copies) and trace replay (tiermoe.analysis.trace_replay
and placement_traffic, with the cost model's copy times), so what the benchmark measures is what serving does.
Legend: L layers, E experts; counts_LE are routed (token, expert) pairs of one pass; mask_LE True = GPU tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermoe.placement.global_topk import top_k_positions


@dataclass(frozen=True)
class Swap:
    """Promote `expert_in` (CPU -> GPU) in `layer` and demote `expert_out` (GPU -> CPU) in `layer_out` (default:
    the same layer). The total GPU count stays; a cross-layer swap moves one GPU slot from `layer_out` to `layer`
    (every supported model has one expert size, so a slot is the same bytes in every layer)."""

    layer: int
    expert_in: int
    expert_out: int
    layer_out: int | None = None

    @property
    def out_layer(self) -> int:
        """The layer the demoted expert leaves the GPU tier in."""
        return self.layer if self.layer_out is None else self.layer_out


def _layer_swaps(layer: int, mask_E: torch.Tensor, want_E: torch.Tensor) -> list[Swap]:
    ins = (want_E & ~mask_E).nonzero().flatten().tolist()
    outs = (mask_E & ~want_E).nonzero().flatten().tolist()
    return [Swap(layer, i, o) for i, o in zip(ins, outs)]


class KTDynamicPolicy:
    """SGLang-kt's --kt-enable-dynamic-expert-update: after a prefill pass of at least `threshold` tokens, each
    layer keeps that pass's most-used experts (same count per layer; ties to the lower id). No history, and
    decode passes never re-place."""

    name = "kt-dynamic"

    def __init__(self, threshold: int | None):
        self.threshold = threshold  # None: never fires (it follows layerwise prefill batches only)
        self._latest: torch.Tensor | None = None

    def observe(self, counts_LE: torch.Tensor, num_tokens: int, is_prefill: bool) -> None:
        if self.threshold is not None and is_prefill and num_tokens >= self.threshold:
            self._latest = counts_LE.detach().to("cpu", torch.float64)

    def propose(self, mask_LE: torch.Tensor, busy_LE: torch.Tensor) -> list[Swap]:
        if self._latest is None:
            return []
        counts, self._latest = self._latest, None
        swaps = []
        for layer in range(mask_LE.shape[0]):
            n = int(mask_LE[layer].sum())
            if n == 0 or counts[layer].sum() == 0:
                continue
            want = torch.zeros_like(mask_LE[layer])
            want[top_k_positions(counts[layer], n)] = True
            swaps += _layer_swaps(layer, mask_LE[layer], want)
        return swaps
