"""Placement by the tiers' time per step: the MoE layer waits for the slower of its two tiers, so what a placement
is worth is the step time the cost model gives it, not its hit rate.

Why: where the GPU tier is the faster one (a real GPU beside a CPU) the CPU tier is the bottleneck of every layer
and the most-routed experts belong on the GPU, as `frequency` places them; where it is not (a weak GPU beside a
big CPU, a PCIe link that is the bottleneck, or `--gpu-profile this-cpu`, where the "GPU" is torch on one core)
hot experts on the GPU tier make it the bottleneck, and a placement that balances the two tiers' time wins (on
this CPU uniform led frequency by 7-21%, BENCHMARKS.md). Both cases are one rule: minimise the expected step time.

Expected work of a pass of n tokens: an expert of rate r (routed pairs per token) is touched with chance
1 - (1 - r)^n and gets n r pairs. Per layer and pass size, the CPU tier's seconds (a x touched + b x pairs, summed
over its experts) and the GPU tier's (its own terms over the sums of its experts' touches and pairs) are combined
as the cost model combines them (tiermoe.placement.pass_cost: max where the tiers overlap, else sum). The per-call
terms (the CPU tier's hand-off, the rows over PCIe, the GPU tier's call) are left out: they are the same for every
placement that keeps both tiers in a layer, as nearly every placement at a ratio strictly between 0 and 1 does; the
cost model's extra per layer in which both tiers compute (one CPU: both_tiers_seconds) is counted by the chance that
both do. With few tokens a pass often leaves a tier idle, so a layer's time is not the larger of its tiers' means:
each tier is idle or busy with a normal time, and the expected maximum is taken (Clark's formula).
Legend: L layers, E experts, N pass sizes; rates are routed pairs per token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from tiermoe.placement.pass_cost import HostCosts, PassCostModel
from tiermoe.placement.tier_time import TierFit

# a swap of the local search must gain at least this share of the step time: an estimate's second decimal is no
# gain worth moving an expert for (near-tied experts, 717 against 714 routed pairs, otherwise trade places)
_RELATIVE_GAIN = 1e-4
# ...and the placement it reaches must beat the best start by this share, or the start stands: the expected step
# time (tiers independent, normal where busy) is an approximation, and on a real GPU at 70% of the experts a search
# that gained 0.1% by it lost 0.2% of the real-size law run's estimate to frequency's mask
_SEARCH_GAIN = 0.01
_INV_SQRT_2PI = (2 * np.pi) ** -0.5


@dataclass(frozen=True)
class PassMix:
    """The sizes of the passes a placement serves, by weight (a decode step of a batch of 8: n = 8)."""

    tokens_N: torch.Tensor  # float64 [N], tokens per pass
    weight_N: torch.Tensor  # float64 [N], how often (any scale)

    @classmethod
    def of(cls, tokens: float) -> PassMix:
        return cls(torch.tensor([float(max(tokens, 1.0))], dtype=torch.float64), torch.ones(1, dtype=torch.float64))

    @classmethod
    def from_weights(cls, weights: dict[int, float], most: int = 4) -> PassMix:
        """Pass sizes by weight; beyond the `most` heaviest, each size's weight goes to the nearest kept one (what a
        valuation costs grows with the sizes, and the rare ones change it little)."""
        kept = sorted(sorted(weights, key=lambda n: (-weights[n], n))[:most])
        merged = dict.fromkeys(kept, 0.0)
        for n, w in weights.items():
            merged[min(kept, key=lambda k: (abs(k - n), k))] += w
        return cls(torch.tensor(kept, dtype=torch.float64), torch.tensor([merged[n] for n in kept],
                                                                         dtype=torch.float64))

    @property
    def tokens(self) -> float:
        """Tokens served per unit of weight (what a per-pass sum is divided by to be per token)."""
        return float((self.weight_N * self.tokens_N).sum())


def rates_from_counts(counts_LE: torch.Tensor, pairs_per_token: float) -> torch.Tensor:
    """Routed pairs per token [L, E]: each layer's shares of its counts times the pairs a token routes (top-k).
    A layer without counts gets uniform rates (dense layers: rows that no mask ever places)."""
    counts = counts_LE.to(torch.float64).clamp(min=0)
    totals = counts.sum(dim=1, keepdim=True)
    shares = torch.where(totals > 0, counts / totals.clamp(min=1e-300), 1.0 / counts.shape[1])
    return shares * pairs_per_token


@dataclass
class _Work:
    """What each expert brings a pass of each size [..., N, L, E], on either tier: chance it is touched, its
    pairs, the CPU tier's seconds (mean, variance), the GPU tier's variance (its mean is the tier's own over the
    sums), and log(1 - touched) (a tier is idle in a pass when none of its experts is touched). numpy arrays."""

    touched: np.ndarray
    pairs: np.ndarray
    cpu: np.ndarray
    cpu_var: np.ndarray
    gpu_var: np.ndarray
    log_idle: np.ndarray

    def on(self, where: np.ndarray) -> _Work:
        """Only the experts where `where` (float 0/1, broadcast) is 1."""
        return _Work(*(getattr(self, f) * where for f in _FIELDS))

    def total(self) -> _Work:
        """Summed over the experts (keepdims): a tier's work in a layer."""
        return _Work(*(getattr(self, f).sum(-1, keepdims=True) for f in _FIELDS))

    def plus(self, other: _Work, sign: float = 1.0) -> _Work:
        return _Work(*(getattr(self, f) + sign * getattr(other, f) for f in _FIELDS))


_FIELDS = ("touched", "pairs", "cpu", "cpu_var", "gpu_var", "log_idle")


def _variance(per_touch: float, per_pair: float, touched, pairs, rate):
    """Of a x touched + b x pairs of one expert over passes: its pairs binomial in the pass's n tokens, touched
    when any is: a^2 t(1-t) + b^2 n r(1-r) + 2ab n r(1-t)."""
    return np.maximum(per_touch ** 2 * touched * (1 - touched) + per_pair ** 2 * pairs * (1 - rate)
                      + 2 * per_touch * per_pair * pairs * (1 - touched), 0.0)


def _gpu_unit(cost: PassCostModel) -> tuple[float, float]:
    """The GPU tier's seconds per touched expert and per pair, one at a time (for the spread of its time only: its
    mean is the tier's own, over the sums)."""
    return _gpu_unit_of(cost.profile, cost.model, cost.gpu_tier, cost.host.op_seconds, cost.device_is_host)


@functools.lru_cache(maxsize=64)
def _gpu_unit_of(profile, model, gpu_tier, op_seconds: float, device_is_host: bool) -> tuple[float, float]:
    """_gpu_unit by what it depends on (a PassCostModel's host costs hold a dict, so the model is no cache key)."""
    cost = PassCostModel(profile, model, TierFit(0.0, 0.0, 0.0, 0.0, 0), HostCosts(op_seconds, 0.0, 0.0),
                         device_is_host=device_is_host, gpu_tier=gpu_tier)
    one, zero = np.ones(()), np.zeros(())
    return float(cost.gpu_tier_seconds(one, zero, called=0.0)), float(cost.gpu_tier_seconds(zero, one, called=0.0))


def _work(cost: PassCostModel, rate, mix: PassMix) -> _Work:
    """rate [..., L, E] -> _Work [..., N, L, E] (a token routes to an expert at most once: rates in [0, 1])."""
    n = mix.tokens_N.numpy()[:, None, None]
    r = np.clip(_array(rate), 0.0, 1.0)[..., None, :, :]
    touched, pairs = 1.0 - (1.0 - r) ** n, n * r
    a, b = cost.cpu.per_expert, cost.cpu.per_pair
    ga, gb = _gpu_unit(cost)
    return _Work(touched, pairs, a * touched + b * pairs, _variance(a, b, touched, pairs, r),
                 _variance(ga, gb, touched, pairs, r), np.log1p(-np.minimum(touched, 1 - 1e-12)))


def _array(x) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    """Phi(x) from erfc's Chebyshev fit (Numerical Recipes' erfcc: relative error < 1.2e-7)."""
    z = np.abs(x) / 2 ** 0.5
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    erfc = t * np.exp(-z * z + poly)
    return np.where(x >= 0, 1.0 - 0.5 * erfc, 0.5 * erfc)


def _busy(mean, var, log_idle):
    """(chance of any work, mean and variance given some work) of a tier."""
    p = np.maximum(1.0 - np.exp(np.minimum(log_idle, 0.0)), 1e-12)
    mean = np.maximum(mean, 0.0)
    given = mean / p
    return p, given, np.maximum((var + mean * mean) / p - given * given, 0.0)


def _layer_seconds(cost: PassCostModel, cpu: _Work, gpu: _Work) -> np.ndarray:
    """Expected seconds of a layer whose tiers do `cpu` and `gpu` (totals). Where the tiers overlap a layer waits for
    the slower one in each pass; each tier is idle or busy with a normal time (independent), and the expected
    maximum is Clark's formula where both are busy. Else the sum. Plus the model's extra for a layer in which both
    compute (both_tiers_seconds), by the chance that both do."""
    gpu_mean = cost.gpu_tier_seconds(np.maximum(gpu.touched, 0.0), np.maximum(gpu.pairs, 0.0), called=0.0)
    p_c, m_c, v_c = _busy(cpu.cpu, cpu.cpu_var, cpu.log_idle)
    p_g, m_g, v_g = _busy(gpu_mean, gpu.gpu_var, gpu.log_idle)
    extra = cost.both_tiers_seconds * p_c * p_g
    if not cost.tiers_overlap:
        return cpu.cpu + gpu_mean + extra
    spread = np.sqrt(np.maximum(v_c + v_g, 1e-30))
    d = (m_c - m_g) / spread
    both = m_c * _normal_cdf(d) + m_g * _normal_cdf(-d) + spread * np.exp(-0.5 * d * d) * _INV_SQRT_2PI
    return p_c * p_g * both + p_c * (1 - p_g) * m_c + (1 - p_c) * p_g * m_g + extra


def step_seconds(cost: PassCostModel, rate_LE: torch.Tensor, mask_LE: torch.Tensor, mix: PassMix) -> float:
    """Expected MoE seconds per token of placement `mask_LE` (bool [L, E]) for routing `rate_LE`."""
    work = _work(cost, rate_LE, mix)
    on_gpu = _array(mask_LE)
    per_pass = _layer_seconds(cost, work.on(1 - on_gpu).total(), work.on(on_gpu).total())[..., 0].sum(-1)  # [N]
    return float((mix.weight_N.numpy() * per_pass).sum()) / mix.tokens


def swap_values(cost: PassCostModel, mix: PassMix, load_rate_LE: torch.Tensor, mask_LE: torch.Tensor,
                in_rate_LE: torch.Tensor | None = None, out_rate_LE: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """What each expert is worth on the GPU tier, in step seconds per token, for the placement `mask_LE` with the
    layers' tier loads from `load_rate_LE`:
        promote [L, E]: the step time saved by moving a CPU-tier expert (at its `in_rate_LE`) to the GPU tier;
        demote [L, E]: the step time lost by moving a GPU-tier expert (at its `out_rate_LE`) to the CPU tier.
    A swap (one in, one out) gains promote - demote: exactly for two layers, to first order within one. Where the
    CPU tier is every layer's bottleneck, promote is the CPU tier's time of the expert (what frequency ranks by);
    where the GPU tier is, promoting costs time (negative) and demoting saves it. Entries of the other tier are 0.
    Several valuations at once: rates [K, L, E] give values [K, L, E] (one pass over the work)."""
    in_rate_LE = load_rate_LE if in_rate_LE is None else in_rate_LE
    out_rate_LE = load_rate_LE if out_rate_LE is None else out_rate_LE
    on_gpu = _array(mask_LE)
    gpu_LE = on_gpu > 0
    on_cpu = 1.0 - on_gpu
    load = _work(cost, load_rate_LE, mix)
    # each expert is valued at its own rate (in_rate on the CPU tier, out_rate on the GPU tier) in a layer that holds
    # the others at theirs: the layer without it, then with it on either tier; promote and demote are both what
    # the layer takes longer with the expert on the CPU tier than on the GPU tier
    own = _work(cost, np.where(gpu_LE, _array(out_rate_LE), _array(in_rate_LE)), mix)
    total = lambda x, where: (x * where).sum(-1, keepdims=True)
    without = lambda x, where: total(x, where) - x * where  # [..., N, L, E]
    cpu_mean, cpu_var = without(load.cpu, on_cpu), without(load.cpu_var, on_cpu)
    cpu_log = without(load.log_idle, on_cpu)
    gpu_touched, gpu_pairs = without(load.touched, on_gpu), without(load.pairs, on_gpu)
    gpu_var, gpu_log = without(load.gpu_var, on_gpu), without(load.log_idle, on_gpu)
    with_cpu = _layer_seconds(cost, _Work(0.0, 0.0, cpu_mean + own.cpu, cpu_var + own.cpu_var, 0.0,
                                          cpu_log + own.log_idle),
                              _Work(gpu_touched, gpu_pairs, 0.0, 0.0, gpu_var, gpu_log))
    with_gpu = _layer_seconds(cost, _Work(0.0, 0.0, cpu_mean, cpu_var, 0.0, cpu_log),
                              _Work(gpu_touched + own.touched, gpu_pairs + own.pairs, 0.0, 0.0, gpu_var + own.gpu_var,
                                    gpu_log + own.log_idle))
    weight = mix.weight_N.numpy()[:, None, None]
    value = (weight * (with_cpu - with_gpu)).sum(-3) / mix.tokens
    return torch.from_numpy(np.where(gpu_LE, 0.0, value)), torch.from_numpy(np.where(gpu_LE, value, 0.0))


def balance_by_time(rate_LE: torch.Tensor, moe_rows_L: torch.Tensor, starts: list[torch.Tensor], cost: PassCostModel,
                    mix: PassMix, max_swaps: int | None = None) -> torch.Tensor:
    """The placement (bool [L, E], as many GPU experts as each start holds) with the least expected step time that
    a local search reaches: from the best of `starts` (e.g. frequency's and uniform's masks, so the result is never
    worse than either by this estimate), swap the CPU-tier expert worth most on the GPU tier for the GPU-tier expert
    worth least (swap_values, any two MoE layers), while that lowers the estimate. rate_LE: routed pairs per token
    of the calibration (rates_from_counts). Where the CPU tier is every layer's bottleneck, frequency's mask is
    already the optimum and nothing moves; where the GPU tier is slower it moves pairs off it until the tiers
    balance. The search's placement is taken only where it beats the best start by _SEARCH_GAIN (1%)."""
    rate = torch.where(moe_rows_L[:, None], rate_LE.to(torch.float64), 0.0)
    timed = [(step_seconds(cost, rate, m, mix), i) for i, m in enumerate(starts)]
    best, first = min(timed)
    start_seconds = best
    mask = starts[first].clone()
    placeable = moe_rows_L[:, None].expand_as(mask)
    limit = max_swaps if max_swaps is not None else 2 * int(mask.sum()) + 16
    for _ in range(limit):
        promote, demote = swap_values(cost, mix, rate, mask)
        gain_in = torch.where(~mask & placeable, promote, -torch.inf).flatten()
        loss_out = torch.where(mask, demote, torch.inf).flatten()
        if not (torch.isfinite(gain_in).any() and torch.isfinite(loss_out).any()):
            break
        moved = False
        # the best few pairs by the first-order gain, each checked exactly (within a layer the gains interact)
        ins = torch.topk(gain_in, min(4, gain_in.numel())).indices.tolist()
        outs = torch.topk(-loss_out, min(4, loss_out.numel())).indices.tolist()
        for i, o in sorted(((i, o) for i in ins for o in outs), key=lambda p: -float(gain_in[p[0]] - loss_out[p[1]])):
            if not (torch.isfinite(gain_in[i]) and torch.isfinite(loss_out[o])) or gain_in[i] - loss_out[o] <= 0:
                break
            trial = mask.clone().flatten()
            trial[i], trial[o] = True, False
            trial = trial.reshape(mask.shape)
            seconds = step_seconds(cost, rate, trial, mix)
            if seconds < best * (1 - _RELATIVE_GAIN):
                mask, best, moved = trial, seconds, True
                break
        if not moved:
            break
    return mask if best <= start_seconds * (1 - _SEARCH_GAIN) else starts[first].clone()
