"""Placement policies: static, KTransformers' dynamic update, and tiermoe's adaptive policy.

A policy sees per-pass routing counts and proposes swaps; it never touches weights. The same objects drive the
live engine (engine/placement_manager.py, with asynchronous copies) and trace replay (stats/replay.py, with
the cost model's copy times), so what the benchmark measures is what serving does.
Legend: L layers, E experts; counts_LE are routed (token, expert) pairs of one pass; mask_LE True = GPU tier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiermoe.placement.cost import BandwidthCostModel
from tiermoe.placement.masks import top_k_positions

POLICIES = ("static", "kt-dynamic", "adaptive")


@dataclass(frozen=True)
class Swap:
    """Promote `expert_in` (CPU -> GPU) and demote `expert_out` (GPU -> CPU) in one layer: the GPU count stays."""

    layer: int
    expert_in: int
    expert_out: int


class StaticPolicy:
    name = "static"

    def observe(self, counts_LE: torch.Tensor, num_tokens: int, is_prefill: bool) -> None:
        pass

    def propose(self, mask_LE: torch.Tensor, busy_LE: torch.Tensor) -> list[Swap]:
        return []


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


@dataclass
class AdaptiveSettings:
    half_life_tokens: float = 2048.0  # how fast the load estimate forgets
    replan_every: int = 8  # passes between re-plans
    horizon_tokens: float | None = None  # how long a swap is expected to pay off (default: the half-life)
    margin: float = 2.0  # hysteresis: swap only when the expected saving exceeds margin x the copy cost
    max_swaps_in_flight: int = 2  # copy budget: two copies at once (double-buffered)
    z_score: float = 2.0  # and only when the load difference exceeds this many standard errors (not noise)


class AdaptivePolicy:
    """Follow the workload: decayed per-expert load over prefill and decode, re-planned every few passes.

    1. Keep load_LE = load_LE x 0.5^(tokens / half_life) + counts_LE after every pass: activations per token,
       recent ones weighing most.
    2. Every `replan_every` passes, in each layer pair the busiest CPU-tier experts with the idlest GPU-tier ones.
    3. A pair is worth it when (rate_in - rate_out) x horizon x saving per activation > margin x copy cost (the
       promotion and the demotion both cross PCIe), and when the difference is real: larger than `z_score`
       standard errors of the two counts (Poisson: sqrt(load_in + load_out)). Near-ties never swap, so placements
       do not churn on sampling noise.
    4. At most `max_swaps_in_flight` swaps at once; experts whose copy is in flight are left alone.
    """

    name = "adaptive"

    def __init__(self, num_layers: int, num_experts: int, cost: BandwidthCostModel,
                 settings: AdaptiveSettings | None = None, initial_counts_LE: torch.Tensor | None = None):
        self.cost = cost
        self.settings = settings or AdaptiveSettings()
        self.load_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        if initial_counts_LE is not None:
            total = float(initial_counts_LE.sum()) or 1.0
            # a prior worth one half-life of traffic, shaped like the calibration statistics
            self.load_LE += initial_counts_LE.double() / total * self.settings.half_life_tokens
        self._passes = 0

    def observe(self, counts_LE: torch.Tensor, num_tokens: int, is_prefill: bool) -> None:
        decay = 0.5 ** (num_tokens / self.settings.half_life_tokens)
        self.load_LE.mul_(decay).add_(counts_LE.detach().to("cpu", torch.float64))
        self._passes += 1

    def propose(self, mask_LE: torch.Tensor, busy_LE: torch.Tensor) -> list[Swap]:
        s = self.settings
        if self._passes % s.replan_every != 0:
            return []
        budget = s.max_swaps_in_flight - int(busy_LE.sum()) // 2
        if budget <= 0:
            return []
        # load_LE sums to about half_life / ln 2 tokens' worth of activations: turn it into a rate per token
        rate_LE = self.load_LE * (math.log(2) / s.half_life_tokens)
        horizon = s.horizon_tokens or s.half_life_tokens
        threshold = s.margin * self.cost.copy_seconds(2) / (horizon * self.cost.saving_per_activation())
        candidates = []
        for layer in range(mask_LE.shape[0]):
            gpu = (mask_LE[layer] & ~busy_LE[layer]).nonzero().flatten()
            cpu = (~mask_LE[layer] & ~busy_LE[layer]).nonzero().flatten()
            if gpu.numel() == 0 or cpu.numel() == 0:
                continue
            ins = cpu[torch.argsort(rate_LE[layer, cpu], descending=True, stable=True)]
            outs = gpu[torch.argsort(rate_LE[layer, gpu], stable=True)]
            for i, o in zip(ins.tolist(), outs.tolist()):
                gain = float(rate_LE[layer, i] - rate_LE[layer, o])
                noise = s.z_score * math.sqrt(float(self.load_LE[layer, i] + self.load_LE[layer, o]))
                if gain <= threshold or float(self.load_LE[layer, i] - self.load_LE[layer, o]) <= noise:
                    break
                candidates.append((gain, layer, i, o))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        return [Swap(layer, i, o) for _, layer, i, o in candidates[:budget]]
