"""The statistics the routing generator is fitted to and checked against, measured the same way on any set of
per-token traces (one per task): the files of `data/routing` or generated ones.

Per task: Gini per MoE layer over the same number of tokens for every task (`gini_tokens`, default the smallest
task's), reuse at lags 1..D and after shuffling each request's tokens, the hit rate of a hot set calibrated on
the task's even requests when serving its odd ones, a per-request oracle's hit rate, the cross-layer correlation
of lag-1 reuse and the cross-layer dependence of a token's experts (with its shuffled floor). Per ordered pair of
tasks: the hit rate of a's hot set on b's routing and the overlap of their hot sets. A hot set is the `hot`
most-routed experts of each layer (default a quarter of them).
Legend: M MoE layers, D lags.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiermoe.routing.measures import (
    cross_layer_correlation,
    cross_layer_dependence,
    gini_by_layer,
    hot_set_hit,
    hot_set_overlap,
    lag_reuse,
    moe_counts,
    request_oracle_hit,
    shuffled_lag_reuse,
    shuffled_order,
    split_by_request,
    task_shuffled_reuse,
)


@dataclass(frozen=True)
class TaskStatistics:
    name: str
    tokens: int
    requests: int
    gini_M: np.ndarray
    lag_D: np.ndarray  # reuse at lags 1..D
    shuffled_D: np.ndarray  # the same with each request's tokens shuffled
    task_shuffled: float  # reuse of two random tokens of the task (task-level popularity alone)
    same_task_hit: float  # hot set of the even requests, served the odd ones
    request_oracle_hit: float
    layer_reuse_correlation: float
    layer_dependence: float  # of a token's experts at adjacent layers
    layer_dependence_shuffled: float  # the same with layer m+1 from another token of the request: the floor

    @property
    def excess_D(self) -> np.ndarray:
        """Reuse beyond what per-request popularity gives: short-range locality per lag."""
        return self.lag_D - self.shuffled_D


@dataclass(frozen=True)
class RoutingStatistics:
    tasks: tuple[TaskStatistics, ...]
    cross_hit: dict  # (calibration task, served task) -> hit rate
    overlap: dict  # (task a, task b) -> hot-set overlap, a < b in task order
    hot: int
    gini_tokens: int

    @property
    def gini_M(self) -> np.ndarray:
        return np.mean([t.gini_M for t in self.tasks], axis=0)

    def mean(self, field: str) -> float | np.ndarray:
        return np.mean([getattr(t, field) for t in self.tasks], axis=0)

    @property
    def mean_cross_hit(self) -> float:
        return float(np.mean(list(self.cross_hit.values()))) if self.cross_hit else float("nan")

    @property
    def mean_overlap(self) -> float:
        return float(np.mean(list(self.overlap.values()))) if self.overlap else float("nan")


def measure_task(name: str, trace: dict, hot: int, gini_tokens: int, max_lag: int,
                 rng: np.random.Generator) -> TaskStatistics:
    even, odd = split_by_request(trace)
    return TaskStatistics(
        name=name, tokens=int(trace["topk_ids"].shape[0]), requests=int(trace["token_request"].unique().numel()),
        gini_M=gini_by_layer(trace, gini_tokens), lag_D=lag_reuse(trace, max_lag),
        shuffled_D=shuffled_lag_reuse(trace, rng, max_lag), task_shuffled=task_shuffled_reuse(trace, rng),
        same_task_hit=hot_set_hit(moe_counts(even), moe_counts(odd), hot),
        request_oracle_hit=request_oracle_hit(trace, hot), layer_reuse_correlation=cross_layer_correlation(trace),
        layer_dependence=cross_layer_dependence(trace),
        layer_dependence_shuffled=cross_layer_dependence(trace, shuffled_order(trace, rng)))


def measure_routing(traces: dict[str, dict], hot: int | None = None, max_lag: int = 8,
                    gini_tokens: int | None = None, rng: np.random.Generator | None = None) -> RoutingStatistics:
    """Statistics of a set of task traces {name: per_token trace}; `rng` shuffles requests (default seed 0)."""
    if not traces:
        raise ValueError("measure_routing needs at least one trace")
    rng = np.random.default_rng(0) if rng is None else rng
    first = next(iter(traces.values()))
    hot = hot or max(1, int(first["num_experts"]) // 4)
    gini_tokens = gini_tokens or min(int(t["topk_ids"].shape[0]) for t in traces.values())
    tasks = tuple(measure_task(name, t, hot, gini_tokens, max_lag, rng) for name, t in traces.items())
    counts = {name: moe_counts(t) for name, t in traces.items()}
    names = list(traces)
    cross = {(a, b): hot_set_hit(counts[a], counts[b], hot) for a in names for b in names if a != b}
    overlap = {(a, b): hot_set_overlap(counts[a], counts[b], hot) for i, a in enumerate(names) for b in names[i + 1:]}
    return RoutingStatistics(tasks, cross, overlap, hot, gini_tokens)
