"""Fitted routing-generator parameters (docs/traces.md, "Routing generator"), refitted with
`benchmarks/bench_routing_generator.py --refit` (which prints this table's entries).

- `esft-deepseek-v2-lite`: fitted to the three ESFT traces of `data/routing/esft-deepseek-v2-lite`
  (DeepSeek-V2-Lite layout: decoder layers 1..26 are MoE, 64 experts, top-6; tasks intent, law, summary).
- `qwen3-30b-a3b`: the skew by depth fitted to the Qwen3-30B-A3B decode heat of `qwen3-moe-heat` (48 x 128, top-8,
  75,773 tokens of 200 prompts); the task, request and local-state parameters are the ESFT ones (the heat has no
  per-token order and no tasks).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermoe.routing.generator import RoutingParams, RoutingShape


@dataclass(frozen=True)
class RoutingPreset:
    params: RoutingParams
    shape: RoutingShape
    tokens_per_request: int  # the files' typical request length (median)


ESFT = RoutingParams(
    skew_by_depth=(0.661, 0.650, 0.725, 0.766, 0.780, 0.899, 0.986, 1.138, 1.118, 0.970, 1.091, 0.975, 1.073, 0.947,
                   0.993, 0.950, 0.770, 0.939, 1.062, 1.019, 1.086, 0.973, 1.036, 1.311, 1.170, 1.045),
    shared=0.215, request_spread=0.090, fast_spread=1.661, fast_keep=0.152,
    slow_spread=1.242, slow_keep=0.957,
    source="ESFT DeepSeek-V2-Lite traces intent, law, summary",
)

QWEN3_SKEW = (0.975, 1.249, 1.428, 1.459, 1.627, 1.603, 1.626, 1.571, 1.442, 1.630, 1.654, 1.513, 1.671, 1.737,
              1.619, 1.622, 1.692, 1.560, 1.654, 1.530, 1.523, 1.622, 1.705, 1.582, 1.763, 1.745, 1.700, 1.665,
              1.643, 1.568, 1.638, 1.546, 1.508, 1.585, 1.689, 1.631, 1.699, 1.711, 1.675, 1.672, 1.741, 1.693,
              1.745, 1.707, 1.759, 1.697, 1.713, 2.004)

PRESETS = {
    "esft-deepseek-v2-lite": RoutingPreset(ESFT, RoutingShape(26, 64, 6, 1, "deepseek_v2"), 226),
    "qwen3-30b-a3b": RoutingPreset(
        RoutingParams(QWEN3_SKEW, ESFT.shared, ESFT.request_spread, ESFT.fast_spread, ESFT.fast_keep,
                      ESFT.slow_spread, ESFT.slow_keep, "Qwen3-30B-A3B decode heat (skew), ESFT traces (the rest)"),
        RoutingShape(48, 128, 8, 0, "qwen3_moe"), 379),
}
