"""Fit the routing generator's parameters (tiermoe.routing.generator) to real traces, by simulation: the
generator is run with the files' shape and request lengths and measured with the same code as the files
(tiermoe.routing.measures), and each parameter is set where its statistic matches.

Before the rounds, `slow_keep` comes from the decay of the files' excess reuse (lag reuse - shuffled) over the
second half of the lags (two tokens d apart share the slow state with probability slow_keep^d). Per round (three
by default, the later ones in brackets around the last values):
1. `skew_by_depth`: one run with a grid of spreads as its layers maps spread -> Gini (at the files' tokens per
   task); each MoE layer gets the spread whose Gini is the layer's mean Gini over the tasks.
2. `shared`: bisection on the mean overlap of the tasks' hot sets (whole tasks simulated).
3. `request_spread`: bisection on the mean lag-1 reuse after shuffling each request (per-request popularity).
4. `slow_spread`: bisection on the excess reuse at the last half of the lags; `fast_spread`: on the excess at
   lag 1; `fast_keep`: on the excess at lag 2; twice over, as they interact. Steps 3-4 simulate about
   SUBSET_TOKENS tokens of whole requests spread over each task, and their targets are measured on the same
   requests of the files.
After the rounds, skew (step 1) and local states (step 4, twice over) are set in turn twice more, and the skew
once last.
Each evaluation reuses one seed, so a statistic moves only with the parameter being set. The depth profile of
another model (a heat matrix: counts per layer and expert) is fitted with step 1 alone (`fit_skew_to_heat`).
Legend: M MoE layers, E experts, G grid spreads, D lags.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from tiermoe.routing.balance import gini
from tiermoe.routing.generator import (
    RoutingParams,
    RoutingShape,
    generate_requests,
    generated_trace,
)
from tiermoe.routing.measures import (
    gini_by_layer,
    hot_set_overlap,
    lag_reuse,
    moe_counts,
    select_tokens,
    shuffled_lag_reuse,
)
from tiermoe.routing.statistics import measure_routing

START = RoutingParams(skew_by_depth=(1.0,), shared=0.4, request_spread=0.6, fast_spread=1.0, fast_keep=0.4,
                      slow_spread=0.3, slow_keep=0.9)
GRID = np.linspace(0.0, 4.0, 41)  # spreads tried for a layer's skew
KEEPS = np.linspace(0.05, 0.99, 95)
SUBSET_TOKENS = 3072  # tokens per task (whole requests) that the reuse bisections simulate
LAG_SWEEPS = 2
FINAL_ALTERNATIONS = 2


@dataclass(frozen=True)
class FitTargets:
    """What the files show, and the shape and request lengths the generator is run with to compare."""

    shape: RoutingShape
    lengths_by_task: tuple[tuple[int, ...], ...]
    gini_M: np.ndarray  # mean over tasks, each over its first gini_tokens tokens
    gini_tokens: int
    overlap: float  # mean hot-set overlap of the task pairs (nan for one task)
    shuffled_lag1: float  # these two on the requests `subset` picks (what the reuse bisections simulate)
    excess_D: np.ndarray  # mean over tasks of lag reuse - shuffled, lags 1..D
    hot: int
    subset: tuple[tuple[int, ...], ...] = ()  # per task, the requests (indices in order) the reuse bisections run


def request_lengths(trace: dict) -> tuple[int, ...]:
    """Tokens of each request, in the order of their first token."""
    _, first, counts = np.unique(trace["token_request"].numpy(), return_index=True, return_counts=True)
    return tuple(int(c) for c in counts[np.argsort(first)])


def targets_from_traces(traces: dict[str, dict], max_lag: int = 8) -> FitTargets:
    """Fit targets from per-task traces of one model (same layers, experts and top-k)."""
    stats = measure_routing(traces, max_lag=max_lag)
    first = next(iter(traces.values()))
    layers = [int(x) for x in first["moe_layers"]]
    shape = RoutingShape(len(layers), int(first["num_experts"]), int(first["topk_ids"].shape[2]), layers[0],
                         str(first.get("model_type", "synthetic")))
    lengths = tuple(request_lengths(t) for t in traces.values())
    subset = tuple(spread_requests(x, SUBSET_TOKENS) for x in lengths)
    rng = np.random.default_rng(0)
    picked = [select_tokens(t, torch.isin(t["token_request"], request_ids(t)[list(chosen)]))
              for t, chosen in zip(traces.values(), subset)]
    shuffled = [shuffled_lag_reuse(t, rng, max_lag) for t in picked]
    excess = np.mean([lag_reuse(t, max_lag) - sh for t, sh in zip(picked, shuffled)], axis=0)
    return FitTargets(shape, lengths, stats.gini_M, stats.gini_tokens, stats.mean_overlap,
                      float(np.mean([sh[0] for sh in shuffled])), excess, stats.hot, subset)


def request_ids(trace: dict) -> torch.Tensor:
    """The trace's request ids in the order of their first token."""
    ids, first = np.unique(trace["token_request"].numpy(), return_index=True)
    return torch.from_numpy(ids[np.argsort(first)])


def simulate(params: RoutingParams, shape: RoutingShape, lengths_by_task, seed: int) -> list[dict]:
    """One generated trace per task."""
    requests = list(generate_requests(params, shape, [list(x) for x in lengths_by_task],
                                      torch.Generator().manual_seed(seed)))
    return [generated_trace(shape, [r for r in requests if r.task == t]) for t in range(len(lengths_by_task))]


def skew_curve(params: RoutingParams, targets: FitTargets, seed: int, grid: np.ndarray = GRID) -> np.ndarray:
    """Mean Gini over tasks [G] of a layer with each spread of `grid` (the other parameters as in `params`)."""
    shape = replace(targets.shape, moe_layers=len(grid))
    traces = simulate(replace(params, skew_by_depth=tuple(grid)), shape, targets.lengths_by_task, seed)
    curve = np.mean([gini_by_layer(t, targets.gini_tokens) for t in traces], axis=0)
    return np.maximum.accumulate(np.convolve(np.pad(curve, 1, mode="edge"), np.ones(3) / 3, mode="valid"))


def invert_curve(target_M: np.ndarray, curve: np.ndarray, grid: np.ndarray = GRID) -> tuple[float, ...]:
    return tuple(float(x) for x in np.interp(target_M, curve, grid))


def bisect(statistic: Callable[[float], float], target: float, lo: float, hi: float, steps: int) -> float:
    """The value in [lo, hi] where an increasing `statistic` meets `target` (an end when it never does)."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if statistic(mid) < target else (lo, mid)
    return (lo + hi) / 2


def spread_requests(lengths: tuple[int, ...], tokens: int) -> tuple[int, ...]:
    """Indices of requests spread evenly over a task that hold about `tokens` tokens (at least two where it has
    them): a sample with the task's mix of short and long requests."""
    want = min(len(lengths), max(2, int(np.ceil(tokens / max(np.mean(lengths), 1)))))
    return tuple(int(i) for i in np.unique(np.linspace(0, len(lengths) - 1, want).round()))


def slow_keep_from_tail(excess_D: np.ndarray) -> float:
    """slow_keep from the decay of the excess over the second half of the lags (log-linear fit)."""
    tail = excess_D[excess_D.size // 2:]
    if tail.size < 2 or (tail <= 0).any():
        return START.slow_keep
    slope = np.polyfit(np.arange(tail.size), np.log(tail), 1)[0]
    return float(np.clip(np.exp(slope), KEEPS[0], KEEPS[-1]))


def fit_routing(targets: FitTargets, rounds: int = 3, steps: int = 6, seed: int = 0, sweeps: int = LAG_SWEEPS,
                alternations: int = FINAL_ALTERNATIONS, start: RoutingParams = START,
                progress: Callable[[str], None] | None = None) -> RoutingParams:
    """Parameters whose generated traces (run like the files) show the targets' statistics."""
    say = progress or (lambda _: None)
    d = targets.excess_D.size
    tail = list(range(d // 2, d))  # lag indices of the slow tail
    params = replace(start, slow_keep=slow_keep_from_tail(targets.excess_D),
                     skew_by_depth=start.skew_by_depth * targets.shape.moe_layers
                     if len(start.skew_by_depth) == 1 else start.skew_by_depth)
    subset = tuple(tuple(lengths[i] for i in chosen) for lengths, chosen in
                   zip(targets.lengths_by_task, targets.subset or [range(len(x)) for x in targets.lengths_by_task]))

    def reuse(p: RoutingParams) -> tuple[np.ndarray, float]:
        """(excess reuse [D], shuffled lag-1 reuse), means over the tasks of one simulation of the subset."""
        traces = simulate(p, targets.shape, subset, seed)
        rng = np.random.default_rng(seed)
        shuffled = [shuffled_lag_reuse(t, rng, d) for t in traces]
        excess = np.mean([lag_reuse(t, d) - s for t, s in zip(traces, shuffled)], axis=0)
        return excess, float(np.mean([s[0] for s in shuffled]))

    def overlap(p: RoutingParams) -> float:
        counts = [moe_counts(t) for t in simulate(p, targets.shape, targets.lengths_by_task, seed)]
        return float(np.mean([hot_set_overlap(a, b, targets.hot) for i, a in enumerate(counts)
                              for b in counts[i + 1:]]))

    def fit(params: RoutingParams, name: str, statistic: Callable[[RoutingParams], float], target: float,
            lo: float, hi: float, narrow: bool) -> RoutingParams:
        value = getattr(params, name)
        if narrow:  # later rounds search near the last value
            lo, hi = max(lo, value * 0.5), min(hi, value * 1.6 + 0.05)
        return replace(params, **{name: bisect(lambda v: statistic(replace(params, **{name: v})), target, lo, hi,
                                               steps)})

    def lag_sweep(narrow: bool) -> RoutingParams:
        fitted = params
        for name, statistic, target, hi in (
                ("slow_spread", lambda p: float(reuse(p)[0][tail].mean()), float(targets.excess_D[tail].mean()), 4.0),
                ("fast_spread", lambda p: float(reuse(p)[0][0]), float(targets.excess_D[0]), 5.0),
                ("fast_keep", lambda p: float(reuse(p)[0][1]), float(targets.excess_D[min(1, d - 1)]), 0.9)):
            if name != "fast_keep" or d > 1:
                fitted = fit(fitted, name, statistic, target, 0.0, hi, narrow)
        return fitted

    for r in range(rounds):
        narrow = r > 0
        params = replace(params, skew_by_depth=invert_curve(targets.gini_M, skew_curve(params, targets, seed)))
        if len(targets.lengths_by_task) > 1 and np.isfinite(targets.overlap):
            params = fit(params, "shared", overlap, targets.overlap, 0.0, 1.0, narrow)
        params = fit(params, "request_spread", lambda p: reuse(p)[1], targets.shuffled_lag1, 0.0, 4.0, narrow)
        for sweep in range(sweeps):  # the three interact: the fast state dilutes the slow one
            params = lag_sweep(narrow or sweep > 0)
        say(f"round {r + 1} of {rounds}: mean skew {np.mean(params.skew_by_depth):.3f}, shared {params.shared:.3f}, "
            f"request {params.request_spread:.3f}, fast {params.fast_spread:.3f} (keep {params.fast_keep:.2f}), "
            f"slow {params.slow_spread:.3f} (keep {params.slow_keep:.2f})")
    # the spreads fitted last flatten the marginals and the skew sets how much a local state changes the experts:
    # skew and local states are set in turn `alternations` more times, the skew last
    for _ in range(alternations):
        params = replace(params, skew_by_depth=invert_curve(targets.gini_M, skew_curve(params, targets, seed)))
        for _ in range(sweeps):
            params = lag_sweep(True)
    return replace(params, skew_by_depth=invert_curve(targets.gini_M, skew_curve(params, targets, seed)))


def fit_skew_to_heat(params: RoutingParams, heat_ME: torch.Tensor, top_k: int, requests: int, seed: int = 0,
                     grid: np.ndarray | None = None) -> tuple[RoutingParams, np.ndarray]:
    """`params` with skew_by_depth fitted to a heat matrix's Gini per layer [M] (counts per MoE layer and expert
    over `requests` requests of about equal length, as many tokens as the heat counts: row sum / top_k), and that
    Gini. The requests are generated as one task: a heat matrix pools its prompts."""
    grid = GRID[::2] if grid is None else grid
    target_M = np.array([gini(row) for row in heat_ME.double()])
    tokens = int(round(float(heat_ME.double().sum(1).mean()) / top_k))
    lengths = (tuple(tokens // requests + (1 if i < tokens % requests else 0) for i in range(requests)),)
    shape = RoutingShape(heat_ME.shape[0], heat_ME.shape[1], top_k)
    targets = FitTargets(shape, lengths, target_M, tokens, float("nan"), 0.0, np.zeros(1), shape.num_experts // 4)
    curve = skew_curve(params, targets, seed, grid)
    return replace(params, skew_by_depth=invert_curve(target_M, curve, grid)), target_M
