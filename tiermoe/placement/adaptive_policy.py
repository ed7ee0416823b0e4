"""tiermoe's adaptive placement policy: an LFU-like estimate of the served workload, pulled toward the calibration
only as far as the evidence supports it, plus a short-window term for the request being served, and swaps only
where the cost model says they pay for their copies.

What real routing showed (docs/traces.md, BENCHMARKS.md "cross-task"): a hot set calibrated on another task is
about as good as a random one, an LFU cache that learns the served task within a few hundred tokens beats every
static placement, and what is left beyond that is temporal locality that decays within 4-8 tokens. The previous
policy learned once per 2048 tokens whether to follow the workload at all and lost to LFU by 3-18 hit-rate points.
Legend: L layers, E experts; rates are routed pairs per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermoe.placement.pass_cost import PassCostModel
from tiermoe.placement.policies import Swap

NONE = float("-inf")


@dataclass
class AdaptiveSettings:
    half_life_tokens: float = 8192.0  # memory of the served workload's estimate (LFU with forgetting)
    replan_every: int = 1  # passes between re-plans
    horizon_tokens: float | None = None  # how long a lasting swap is expected to pay (default: half the half-life)
    margin: float = 1.0  # swap only when the expected saving exceeds margin x the copies it needs
    max_swaps_in_flight: int = 4  # copy budget, as the caches' default --copy-budget
    z_score: float = 2.0  # follow the evidence only this many standard errors past noise
    recent_half_life_tokens: float = 8.0  # the short window: temporal locality decays by lag 4-8


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


def shrunk_shares(counts_LE: torch.Tensor, prior_share_LE: torch.Tensor, z_score: float) -> torch.Tensor:
    """Each layer's routing shares: the served counts pulled toward the prior, James-Stein style, by as many
    pseudo-pairs as the evidence warrants. The squared distance between served and prior shares is noise
    (1 - sum s^2) / N plus the real difference; with the real difference d estimated (less z standard errors of
    the noise term), the prior weighs (1 - sum s^2) / d pairs: all the weight while nothing shows a difference
    (a workload that matches its calibration never moves), little once another task is plainly being served."""
    pairs = counts_LE.sum(dim=1, keepdim=True)
    shares = counts_LE / pairs.clamp(min=1e-300)
    spread = 1.0 - (shares * shares).sum(dim=1, keepdim=True)
    noise = spread / pairs.clamp(min=1.0)
    distance = ((shares - prior_share_LE) ** 2).sum(dim=1, keepdim=True)
    difference = distance - noise * (1.0 + z_score * (2.0 / max(1, counts_LE.shape[1] - 1)) ** 0.5)
    weight = torch.where(difference > 0, spread / difference.clamp(min=1e-300), torch.full_like(pairs, 1e300))
    return (counts_LE + weight * prior_share_LE) / (pairs + weight)


class AdaptivePolicy:
    """Follow the served workload as an LFU cache does, but from the calibration, with the request's recent
    routing, and only where a swap pays for its copies.

    1. Lasting rate of each expert: decayed routed pairs (`half_life_tokens`) shrunk toward the calibration
       shares (shrunk_shares: evidence decides how far). Before any routing it is the calibration.
    2. Near-term rate over the next `recent_half_life_tokens` tokens: lasting + w x (recent - lasting), recent
       from counts decayed over that short window; w in [0, 1] is learned online by scoring each forecast against
       what the next window routed, read at the lower end of its `z_score` interval (0 until shown, so a workload
       without temporal locality is never chased).
    3. What an expert saves per token on the GPU tier is the cost model's (tiermoe.placement.pass_cost) over the
       recent mix of pass sizes (saving_per_token). A swap (one in, one out, in one layer) is worth the larger of
       a lasting move (near-term saving over the short window, lasting saving for the rest of `horizon_tokens`,
       less its copies) and a passing one (near-term saving only, less its copies and the copies back); it is
       made when that exceeds `margin` x its copies, best first, at most `max_swaps_in_flight` at once, never
       on an expert whose copy is in flight.
    """

    name = "adaptive"

    def __init__(self, num_layers: int, num_experts: int, cost: PassCostModel,
                 settings: AdaptiveSettings | None = None, initial_counts_LE: torch.Tensor | None = None):
        self.cost = cost
        self.settings = settings or AdaptiveSettings()
        shape = (num_layers, num_experts)
        self.load_LE = torch.zeros(shape, dtype=torch.float64)  # decayed routed pairs (lasting estimate)
        self._tokens = 0.0
        self.recent_LE = torch.zeros(shape, dtype=torch.float64)  # routed pairs over the short window
        self._recent_tokens = 0.0
        if initial_counts_LE is not None:
            prior = initial_counts_LE.detach().to("cpu", torch.float64).clamp(min=0)
        else:
            prior = torch.ones(shape, dtype=torch.float64)
        totals = prior.sum(dim=1, keepdim=True)
        self.prior_share_LE = torch.where(totals > 0, prior / totals.clamp(min=1e-300), 1.0 / num_experts)
        self._open: list | None = None  # the forecast awaiting its window: [recent - lasting, lasting, counts, n]
        self._locality = _PersistenceFit()
        self._mix: dict[int, float] = {}  # decayed weight of recent passes by their tokens
        self._passes = 0
        self.last_LE = torch.zeros(shape, dtype=torch.float64)  # the last pass's routed pairs

    @property
    def horizon(self) -> float:
        return self.settings.horizon_tokens or self.settings.half_life_tokens / 2

    @property
    def recent_weight(self) -> float:
        """w: how much of the short window's deviation carries over it (lower confidence end; 0 until shown)."""
        return self._locality.slope(self.settings.z_score)

    def observe(self, counts_LE: torch.Tensor, num_tokens: int, is_prefill: bool) -> None:
        if num_tokens <= 0:
            return
        s = self.settings
        counts = counts_LE.detach().to("cpu", torch.float64)
        self._score_forecast(counts, num_tokens)
        decay = 0.5 ** (num_tokens / s.half_life_tokens)
        self.load_LE.mul_(decay).add_(counts)
        self._tokens = self._tokens * decay + num_tokens
        short = 0.5 ** (num_tokens / s.recent_half_life_tokens)
        self.recent_LE.mul_(short).add_(counts)
        self._recent_tokens = self._recent_tokens * short + num_tokens
        for key in list(self._mix):
            self._mix[key] *= decay
            if self._mix[key] < 1e-6:
                del self._mix[key]
        self._mix[num_tokens] = self._mix.get(num_tokens, 0.0) + 1.0
        self._passes += 1
        self.last_LE = counts
        if self._open is None:  # one forecast open at a time: overlapping ones would overstate the evidence
            lasting = self.lasting_rates()
            self._open = [self.recent_LE / self._recent_tokens - lasting, lasting, torch.zeros_like(counts), 0.0]

    def _score_forecast(self, counts_LE: torch.Tensor, num_tokens: int) -> None:
        if self._open is None:
            return
        self._open[2] += counts_LE
        self._open[3] += num_tokens
        if self._open[3] >= self.settings.recent_half_life_tokens:
            deviation, lasting, counts, tokens = self._open
            self._locality.add(deviation, counts / tokens - lasting)
            self._open = None

    def lasting_rates(self) -> torch.Tensor:
        """Forecast routed pairs per token [L, E] of the served workload (the calibration until routing is seen)."""
        if self._tokens <= 0:
            return self.prior_share_LE.clone()  # shares: the ranking is all a placement needs before routing
        per_layer_k = self.load_LE.sum(dim=1, keepdim=True) / self._tokens
        return shrunk_shares(self.load_LE, self.prior_share_LE, self.settings.z_score) * per_layer_k

    def rates(self) -> torch.Tensor:
        """Forecast routed pairs per token [L, E] over the next short window."""
        lasting = self.lasting_rates()
        if self._recent_tokens <= 0:
            return lasting
        return (lasting + self.recent_weight * (self.recent_LE / self._recent_tokens - lasting)).clamp(min=0.0)

    def saving_per_token(self, rate_LE: torch.Tensor) -> torch.Tensor:
        """Expected seconds saved per token [L, E] by having each expert on the GPU tier, over the recent passes:
        a pass of n tokens touches an expert of rate r with chance 1 - (1 - r)^n and routes n r pairs to it."""
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
        budget = min(s.max_swaps_in_flight - int(busy_LE.sum()) // 2, mask_LE.shape[1])
        if budget <= 0:
            return []
        near_LE = self.saving_per_token(self.rates())
        lasting_LE = self.saving_per_token(self.lasting_rates())
        # the r-th most valuable CPU-tier expert of each layer against its r-th least valuable GPU-tier one
        wanted = ~mask_LE & ~busy_LE & (self.last_LE > 0)  # promote on demand: the next token likely reuses it
        in_val, in_idx = torch.topk(torch.where(wanted, near_LE, NONE), budget, dim=1)
        out_val, out_idx = torch.topk(torch.where(mask_LE & ~busy_LE, -near_LE, NONE), budget, dim=1)
        window = min(s.recent_half_life_tokens, self.horizon)
        near = window * (in_val + out_val)
        lasting = (self.horizon - window) * (lasting_LE.gather(1, in_idx) - lasting_LE.gather(1, out_idx))
        copies = s.margin * self.cost.copy_seconds(2)  # a passing move also pays the copies back
        gain = torch.maximum(near + lasting - copies, near - 2 * copies)
        gain = torch.where(torch.isfinite(in_val) & torch.isfinite(out_val), gain, NONE)
        best_val, best = torch.topk(gain.flatten(), budget)
        swaps = []
        for value, pos in zip(best_val.tolist(), best.tolist()):
            if value <= 0:
                break
            layer, rank = divmod(pos, budget)
            swaps.append(Swap(layer, int(in_idx[layer, rank]), int(out_idx[layer, rank])))
        return swaps
