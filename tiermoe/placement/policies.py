"""Placement policies: KTransformers' dynamic update and tiermoe's adaptive policy ("static" is no policy at all).

A policy sees per-pass routing counts and proposes swaps; it never touches weights. The same objects drive the
live engine (engine/placement_manager.py, with asynchronous copies) and trace replay (tiermoe.analysis.trace_replay
and placement_traffic, with the cost model's copy times), so what the benchmark measures is what serving does.
Legend: L layers, E experts; counts_LE are routed (token, expert) pairs of one pass; mask_LE True = GPU tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermoe.placement.global_topk import top_k_positions
from tiermoe.placement.pass_cost import PassCostModel


@dataclass(frozen=True)
class Swap:
    """Promote `expert_in` (CPU -> GPU) and demote `expert_out` (GPU -> CPU) in one layer: the GPU count stays."""

    layer: int
    expert_in: int
    expert_out: int


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
    half_life_tokens: float = 2048.0  # how fast the online estimate forgets
    replan_every: int = 8  # passes between re-plans
    horizon_tokens: float | None = None  # how long a swap is expected to pay off (default: the half-life)
    margin: float = 2.0  # swap only when the expected saving exceeds margin x the copy cost
    max_swaps_in_flight: int = 2  # copy budget: two copies at once (double-buffered)
    z_score: float = 2.0  # follow the workload only as far as the evidence is this many standard errors firm


class _PersistenceFit:
    """One regression slope through the origin, target on regressor, read at the lower end of its confidence
    interval: how much of a deviation carries over, counted only once the evidence says so."""

    def __init__(self):
        self.cov = self.var = self.noise = 0.0

    def add(self, regressor: torch.Tensor, target: torch.Tensor) -> None:
        self.cov += float((regressor * target).sum())
        self.var += float((regressor * regressor).sum())
        self.noise += float((regressor * target).pow(2).sum())  # variance of cov were there nothing to carry

    def slope(self, z_score: float) -> float:
        if self.var <= 0:
            return 0.0
        return min(1.0, max(0.0, (self.cov - z_score * self.noise ** 0.5) / self.var))


class AdaptivePolicy:
    """Follow the workload only as far as following it has paid off: never behind the static placement it starts
    from unless the workload really differs.

    The placement starts where `frequency` puts it (the calibration statistics, the prior p_LE; a placement that
    starts elsewhere is moved toward it, as far as that pays); every `replan_every` passes the policy asks whether
    a swap pays for its copies. What decides it:

    1. The forecast of each expert's routed pairs per token over the next `horizon_tokens`:
       p + a (m - p) + b (x - m), where m is the rate over everything served so far (a lasting difference between
       this workload and the calibration) and x the recent rate (counts decayed with `half_life_tokens`: temporal
       locality). Raw counts are noisy and partly a passing fluctuation (one long prompt routes alike for
       hundreds of tokens and says little about the next request), so a and b in [0, 1] are learned online: at a
       re-plan the deviations are kept, and once `horizon_tokens` more tokens have passed the realised deviation
       y - p of those tokens is regressed on m - p (giving a) and what is left on x - m (giving b), one forecast
       open at a time. Each is read at the lower end of its `z_score` confidence interval, so both are 0 until
       the evidence shows that a deviation carries over. A workload that matches the calibration and has no
       temporal locality gives a = b = 0: the policy stays on frequency and pays no copies.
       This replaces the old rule (raw decayed counts, the prior forgotten after a half-life, a z-test on the
       busiest-CPU vs idlest-GPU pair), which on near-uniform routing mistook noise and per-prompt correlation
       for hot experts: the extremes of a handful of noisy counts always differ "significantly".
    2. The value of a swap is the cost model's (tiermoe.placement.pass_cost, the model `tiermoe bench placement`
       validates), read per expert: over the recent mix of pass sizes, an expert costs a pass of n tokens its
       per-expert time on its tier when the pass touches it (1 - (1 - r)^n at rate r) plus its per-pair time for
       its n r pairs (on a profiled GPU tier: its read or its math, whichever is slower). The difference between
       the tiers is what being on the GPU tier saves. In large decode batches, where every expert of a layer is
       touched anyway, only the pairs' share differs, and a swap seldom pays for its copies.
    3. A swap happens only when the expected saving over `horizon_tokens` exceeds `margin` x its copy cost (the
       promotion and the demotion both cross PCIe), at most `max_swaps_in_flight` at once, never on experts whose
       copy is in flight.
    """

    name = "adaptive"

    def __init__(self, num_layers: int, num_experts: int, cost: PassCostModel,
                 settings: AdaptiveSettings | None = None, initial_counts_LE: torch.Tensor | None = None):
        self.cost = cost
        self.settings = settings or AdaptiveSettings()
        self.load_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)  # decayed routed pairs
        self._tokens = 0.0  # decayed tokens: load_LE / _tokens is the recent rate
        self.served_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)  # every routed pair so far
        self._served_tokens = 0.0
        if initial_counts_LE is not None:
            prior = initial_counts_LE.detach().to("cpu", torch.float64).clamp(min=0)
        else:
            prior = torch.ones(num_layers, num_experts, dtype=torch.float64)
        totals = prior.sum(dim=1, keepdim=True)
        # each layer's share of its routed pairs (uniform where there are no statistics)
        self.prior_share_LE = torch.where(totals > 0, prior / totals.clamp(min=1e-300), 1.0 / num_experts)
        self._open: list | None = None  # the forecast awaiting its horizon: [m - p, x - m, p, counts, tokens]
        self._shift, self._locality = _PersistenceFit(), _PersistenceFit()
        self._mix: dict[int, float] = {}  # decayed weight of recent passes by their tokens
        self._passes = 0

    @property
    def horizon(self) -> float:
        return self.settings.horizon_tokens or self.settings.half_life_tokens

    @property
    def persistence(self) -> tuple[float, float]:
        """(a, b): how much of the workload's lasting difference from the calibration, and of its recent
        deviation from its own average, carries over the horizon (lower confidence ends; 0 until shown)."""
        return self._shift.slope(self.settings.z_score), self._locality.slope(self.settings.z_score)

    def observe(self, counts_LE: torch.Tensor, num_tokens: int, is_prefill: bool) -> None:
        if num_tokens <= 0:
            return
        counts = counts_LE.detach().to("cpu", torch.float64)
        self._check_forecast(counts, num_tokens)
        decay = 0.5 ** (num_tokens / self.settings.half_life_tokens)
        self.load_LE.mul_(decay).add_(counts)
        self._tokens = self._tokens * decay + num_tokens
        self.served_LE += counts
        self._served_tokens += num_tokens
        for key in list(self._mix):
            self._mix[key] *= decay
            if self._mix[key] < 1e-6:
                del self._mix[key]
        self._mix[num_tokens] = self._mix.get(num_tokens, 0.0) + 1.0
        self._passes += 1
        if self._passes % self.settings.replan_every == 0 and self._open is None:
            # one forecast open at a time: overlapping ones would share their outcome and overstate the evidence
            prior, served, recent = self._prior(), self.served_LE / self._served_tokens, self.load_LE / self._tokens
            self._open = [served - prior, recent - served, prior, torch.zeros_like(prior), 0.0]

    def _check_forecast(self, counts_LE: torch.Tensor, num_tokens: int) -> None:
        """Score the open forecast once this pass completes its horizon."""
        if self._open is None:
            return
        self._open[3] += counts_LE
        self._open[4] += num_tokens
        if self._open[4] < self.horizon:
            return
        shift, recent, prior, counts, tokens = self._open
        realised = counts / tokens - prior
        self._shift.add(shift, realised)
        self._locality.add(recent, realised - self._shift.slope(self.settings.z_score) * shift)
        self._open = None

    def _prior(self) -> torch.Tensor:
        """Prior routed pairs per token [L, E]: the calibration shares times each layer's observed top-k."""
        per_layer_k = self.load_LE.sum(dim=1, keepdim=True) / max(self._tokens, 1e-300)
        return (self.prior_share_LE * per_layer_k).clamp(max=1.0)

    def rates(self) -> torch.Tensor:
        """Forecast routed pairs per token [L, E] over the horizon."""
        prior = self._prior()
        if self._tokens <= 0:
            return prior
        a, b = self.persistence
        served, recent = self.served_LE / self._served_tokens, self.load_LE / self._tokens
        return (prior + a * (served - prior) + b * (recent - served)).clamp(min=0.0)

    def saving_per_token(self, rate_LE: torch.Tensor) -> torch.Tensor:
        """Expected seconds saved per token [L, E] by having each expert on the GPU tier, over the recent passes."""
        total = torch.zeros_like(rate_LE)
        tokens = 0.0
        for n, weight in self._mix.items():
            touched = 1.0 - (1.0 - rate_LE.clamp(0.0, 1.0)) ** n
            pairs = n * rate_LE
            total += weight * (self.cost.expert_seconds(False, touched, pairs)
                               - self.cost.expert_seconds(True, touched, pairs))
            tokens += weight * n
        return total / tokens if tokens else total

    def propose(self, mask_LE: torch.Tensor, busy_LE: torch.Tensor) -> list[Swap]:
        s = self.settings
        if self._passes == 0 or self._passes % s.replan_every != 0:
            return []
        budget = s.max_swaps_in_flight - int(busy_LE.sum()) // 2
        if budget <= 0:
            return []
        value_LE = self.saving_per_token(self.rates())
        threshold = s.margin * self.cost.copy_seconds(2) / self.horizon  # seconds per token a swap must save
        candidates = []
        for layer in range(mask_LE.shape[0]):
            gpu = (mask_LE[layer] & ~busy_LE[layer]).nonzero().flatten()
            cpu = (~mask_LE[layer] & ~busy_LE[layer]).nonzero().flatten()
            if gpu.numel() == 0 or cpu.numel() == 0:
                continue
            ins = cpu[torch.argsort(value_LE[layer, cpu], descending=True, stable=True)]
            outs = gpu[torch.argsort(value_LE[layer, gpu], stable=True)]
            for i, o in zip(ins.tolist(), outs.tolist()):
                gain = float(value_LE[layer, i] - value_LE[layer, o])
                if gain <= threshold:
                    break
                candidates.append((gain, layer, i, o))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        return [Swap(layer, i, o) for _, layer, i, o in candidates[:budget]]
