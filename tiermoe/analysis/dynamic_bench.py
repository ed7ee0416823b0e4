"""`tiermoe bench dynamic`: every placement policy replayed on a trace, per GPU ratio.

Static strategies (statistics from a calibration trace or stats file; time-balanced with the cost model too),
KT-compatible dynamic, the LRU and LFU expert caches (`copy_budget` swaps under way), adaptive, and the ceilings
(Belady with the same copy budget, the trace's static top-k, the per-request and per-window oracles); per ratio the
GPU hit rate, the estimated time (copies charged) and the copy traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermoe.analysis.trace_replay import REPLAY_POLICIES, TracePasses, replay
from tiermoe.config import AdaptiveSettings
from tiermoe.placement.cache_policies import DEFAULT_COPY_BUDGET
from tiermoe.placement.pass_cost import PassCostModel, expert_cost_model
from tiermoe.placement.profiles import GPUProfile
from tiermoe.placement.strategies import NEEDS_STATISTICS
from tiermoe.placement.tier_time import (
    DEFAULT_CPU_FLOPS,
    DEFAULT_CPU_READ_BANDWIDTH,
    assumed_cpu_tier,
)

DEFAULT_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def replay_cost_model(spec, gpu: GPUProfile, cpu_bandwidth: float = DEFAULT_CPU_READ_BANDWIDTH,
                      cpu_flops: float = DEFAULT_CPU_FLOPS) -> PassCostModel:
    """The cost model (tiermoe.placement.pass_cost) with `tiermoe bench dynamic`'s assumptions: bf16 experts of
    `spec`, the GPU tier and copies from the `gpu` profile, the CPU tier reading at `cpu_bandwidth` bytes/s and
    computing at `cpu_flops` (2 flops per expert weight and routed pair)."""
    bytes_per_expert, flops_per_pair = spec.bytes_per_expert(torch.bfloat16), 2.0 * spec.params_per_expert
    return expert_cost_model(bytes_per_expert, flops_per_pair, gpu,
                             assumed_cpu_tier(bytes_per_expert, flops_per_pair, cpu_bandwidth, cpu_flops))


@dataclass
class DynamicBenchResult:
    ratios: list[float]
    policies: list[str]
    rows: list[dict]  # one summary per (policy, ratio)

    def get(self, policy: str, ratio: float) -> dict:
        return next(r for r in self.rows if r["policy"] == policy and abs(r["gpu_ratio"] - ratio) < 1e-9)


def run_dynamic_bench(passes: TracePasses, cost: PassCostModel, ratios=DEFAULT_RATIOS,
                      calibration_LE: torch.Tensor | None = None, prefill_threshold: int | None = None,
                      policies=REPLAY_POLICIES, progress=None, copy_budget: int = DEFAULT_COPY_BUDGET,
                      adaptive: AdaptiveSettings | None = None) -> DynamicBenchResult:
    """adaptive: the adaptive policy's settings (default: its defaults with `copy_budget` swaps in flight)."""
    chosen = [p for p in policies if (calibration_LE is not None or p not in NEEDS_STATISTICS)
              and (passes.request_runs_P is not None or p != "oracle-request")]  # a trace without its requests
    rows = []
    for ratio in ratios:
        for policy in chosen:
            result = replay(passes, policy, ratio, cost, calibration_LE, prefill_threshold, adaptive=adaptive,
                            copy_budget=copy_budget)
            rows.append(result.summary())
            if progress:
                progress(policy, ratio)
    return DynamicBenchResult(list(ratios), chosen, rows)


def format_table(bench: DynamicBenchResult, field: str, fmt: str, title: str) -> str:
    width = max(10, *(len(p) for p in bench.policies)) + 2
    lines = [title, "ratio " + "".join(f"{p:>{width}}" for p in bench.policies)]
    for ratio in bench.ratios:
        cells = []
        for policy in bench.policies:
            value = bench.get(policy, ratio)[field]
            cells.append(f"{(fmt.format(value) if value is not None else '-'):>{width}}")
        lines.append(f"{ratio:<6.2f}" + "".join(cells))
    return "\n".join(lines)
