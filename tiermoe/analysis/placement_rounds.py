"""Timed cells of `tiermoe bench placement --gpu-profile this-cpu --timed-strategies ...`: configurations served end
to end on this CPU in alternating rounds, reported as each one's median and spread over the rounds.

Why rounds and medians: the estimate is validated at a few cells, but the claim "placement A is at least as fast as
placement B on this machine" is a measurement. On a 2-core box the speed drifts by several percent over minutes, so
every configuration runs once per round, the order rotated from round to round (each sees the early and the late
slots alike), and a cell is the median of its rounds, with the spread (fastest - slowest) beside it: A is not below B
when A's median is at least B's less the larger of their spreads. Dynamic strategies run live (the placement manager,
its swaps copied on this CPU), with the cost model the estimate uses.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from tiermoe.analysis.placement_live import measure_configuration
from tiermoe.analysis.placement_workload import Workload


def time_in_rounds(llm, workload: Workload, configs: list[tuple[str, float]], calibration_LE, config, cost,
                   log: Callable[[str], None]) -> list[dict]:
    """Serve every (strategy, ratio) of `configs` once per round, `config.repeats` rounds (config: a
    PlacementBenchConfig), the order rotated each round. Per configuration: output tokens/s of every round (in round
    order), their median and spread, and the swaps and copies of the median round."""
    runs: dict[tuple[str, float], list[tuple[float, dict]]] = {key: [] for key in configs}
    for r in range(config.repeats):
        shift = r % len(configs)
        for strategy, ratio in configs[shift:] + configs[:shift]:
            timing, traffic = measure_configuration(llm, workload, strategy, ratio, calibration_LE, config.concurrency,
                                                    config.prefill_chunk, config.prefill_threshold, cost, config.seed,
                                                    adaptive=config.adaptive)
            runs[(strategy, ratio)].append((timing.output_tokens_per_s, traffic))
            log(f"[placement] timed {strategy} @ {ratio:.2f} (round {r + 1}/{config.repeats}): "
                f"{timing.output_tokens_per_s:.2f} out tok/s, hit rate "
                f"{traffic['gpu_pairs'] / max(1, traffic['pairs']):.1%}, {traffic['swaps']} swaps")
    return [summarise(strategy, ratio, rounds) for (strategy, ratio), rounds in runs.items()]


def summarise(strategy: str, ratio: float, rounds: list[tuple[float, dict]]) -> dict:
    speeds = [speed for speed, _ in rounds]
    median = statistics.median(speeds)
    _, traffic = min(rounds, key=lambda r: abs(r[0] - median))
    return {"strategy": strategy, "ratio": ratio, "rounds_output_tokens_per_s": speeds,
            "median_output_tokens_per_s": median, "spread_output_tokens_per_s": max(speeds) - min(speeds),
            "hit_rate": traffic["gpu_pairs"] / max(1, traffic["pairs"]), "swaps": traffic["swaps"],
            "swap_bytes": traffic["swap_bytes"]}


def not_below(timed: list[dict], judged: str, baseline: str, ratio: float) -> tuple[bool, float] | None:
    """Is `judged` at or above `baseline` at `ratio`, within the larger of their spreads? (ok, margin in % of the
    baseline's median); None when either was not timed there."""
    cell = {t["strategy"]: t for t in timed if abs(t["ratio"] - ratio) < 1e-9}
    if judged not in cell or baseline not in cell:
        return None
    a, b = cell[judged], cell[baseline]
    spread = max(a["spread_output_tokens_per_s"], b["spread_output_tokens_per_s"])
    margin = 100.0 * (a["median_output_tokens_per_s"] / b["median_output_tokens_per_s"] - 1.0)
    return a["median_output_tokens_per_s"] >= b["median_output_tokens_per_s"] - spread, margin
