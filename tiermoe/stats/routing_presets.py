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
    skew_by_depth=(0.639, 0.627, 0.707, 0.745, 0.758, 0.856, 0.953, 1.072, 1.052, 0.937, 1.027, 0.943, 1.011, 0.916,
                   0.959, 0.919, 0.748, 0.908, 1.001, 0.977, 1.022, 0.940, 0.987, 1.163, 1.104, 0.992),
    shared=0.238, request_spread=0.164, fast_spread=2.401, fast_keep=0.329, slow_spread=1.058, slow_keep=0.925,
    source="ESFT DeepSeek-V2-Lite traces intent, law, summary",
)

QWEN3_SKEW = (0.8,) * 48

PRESETS = {
    "esft-deepseek-v2-lite": RoutingPreset(ESFT, RoutingShape(26, 64, 6, 1, "deepseek_v2"), 226),
    "qwen3-30b-a3b": RoutingPreset(
        RoutingParams(QWEN3_SKEW, ESFT.shared, ESFT.request_spread, ESFT.fast_spread, ESFT.fast_keep,
                      ESFT.slow_spread, ESFT.slow_keep, "Qwen3-30B-A3B decode heat (skew), ESFT traces (the rest)"),
        RoutingShape(48, 128, 8, 0, "qwen3_moe"), 379),
}
