"""Fitted routing-generator parameters (docs/traces.md, "Routing generator"), refitted with
`benchmarks/bench_routing_generator.py --refit` (which prints this table's entries).

- `esft-deepseek-v2-lite`: fitted to the three ESFT traces of `../shared/routing-data/esft-deepseek-v2-lite`
  (DeepSeek-V2-Lite layout: decoder layers 1..26 are MoE, 64 experts, top-6; tasks intent, law, summary).
- `qwen3-30b-a3b`: the skew by depth fitted to the Qwen3-30B-A3B decode heat of `qwen3-moe-heat` (48 x 128, top-8,
  75,773 tokens of 200 prompts); the task, request and local-state parameters are the ESFT ones (the heat has no
  per-token order and no tasks).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermoe.stats.routing_generator import RoutingParams, RoutingShape


@dataclass(frozen=True)
class RoutingPreset:
    params: RoutingParams
    shape: RoutingShape
    tokens_per_request: int  # the files' typical request length (median)


ESFT = RoutingParams(
    skew_by_depth=(0.647, 0.636, 0.712, 0.751, 0.764, 0.867, 0.963, 1.105, 1.081, 0.946, 1.052, 0.952, 1.034, 0.924,
                   0.970, 0.927, 0.755, 0.916, 1.022, 0.988, 1.047, 0.949, 0.998, 1.216, 1.140, 1.006),
    shared=0.215, request_spread=0.090, fast_spread=1.385, fast_keep=0.156,
    slow_spread=1.427, slow_keep=0.957,
    source="ESFT DeepSeek-V2-Lite traces intent, law, summary",
)

QWEN3_SKEW = (0.955, 1.230, 1.395, 1.423, 1.595, 1.566, 1.593, 1.533, 1.405, 1.598, 1.622, 1.476, 1.639, 1.704,
              1.585, 1.589, 1.660, 1.522, 1.622, 1.493, 1.485, 1.589, 1.672, 1.544, 1.729, 1.711, 1.667, 1.633,
              1.612, 1.530, 1.606, 1.508, 1.470, 1.547, 1.657, 1.599, 1.666, 1.678, 1.642, 1.639, 1.708, 1.660,
              1.712, 1.674, 1.726, 1.665, 1.680, 1.790)

PRESETS = {
    "esft-deepseek-v2-lite": RoutingPreset(ESFT, RoutingShape(26, 64, 6, 1, "deepseek_v2"), 226),
    "qwen3-30b-a3b": RoutingPreset(
        RoutingParams(QWEN3_SKEW, ESFT.shared, ESFT.request_spread, ESFT.fast_spread, ESFT.fast_keep,
                      ESFT.slow_spread, ESFT.slow_keep, "Qwen3-30B-A3B decode heat (skew), ESFT traces (the rest)"),
        RoutingShape(48, 128, 8, 0, "qwen3_moe"), 379),
}
