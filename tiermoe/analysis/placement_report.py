"""Placement benchmark output: markdown tables in the layout of KTransformers' published one (rows = GPU expert
ratio, columns = strategy), the validation table, and a plot of tokens/s against ratio per strategy.

Estimated figures say so in every header and in the plot title.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from tiermoe.analysis.placement_result import Cell, PlacementBenchResult
from tiermoe.config import AdaptiveSettings

# (title, how the figure was obtained: "throughput" figures are estimates in estimated mode, "traffic" ones are
# exact replays of the measured workload), the value, its format
FIELDS: list[tuple[str, str, Callable[[Cell], float], str]] = [
    ("Output tokens/s", "throughput", lambda c: c.output_tokens_per_s, "{:.1f}"),
    ("Total tokens/s (prompt + output)", "throughput", lambda c: c.total_tokens_per_s, "{:.1f}"),
    ("Mean time to first token, ms", "throughput", lambda c: 1e3 * c.ttft_seconds["mean"], "{:.0f}"),
    ("GPU-tier hit rate, %", "traffic", lambda c: 100 * c.hit_rate, "{:.1f}"),
    ("CPU expert MB read per output token", "traffic", lambda c: c.cpu_expert_bytes_per_output_token / 1e6, "{:.2f}"),
    ("Expert MB copied between tiers", "traffic", lambda c: c.expert_bytes_copied / 1e6, "{:.1f}"),
]


def how(result: PlacementBenchResult, kind: str) -> str:
    profile = result.gpu_profile.get("name", "?")
    if not result.estimated:
        return "measured end to end"
    if kind == "throughput":
        return f"ESTIMATE: cost model, GPU profile {profile}, CPU tier measured on this machine"
    return "exact: the measured workload's routing replayed through each placement"


def table(result: PlacementBenchResult, value: Callable[[Cell], float], fmt: str, title: str) -> str:
    lines = [f"**{title}**", "", "| GPU Expert Ratio | " + " | ".join(result.strategies) + " |",
             "|---|" + "---|" * len(result.strategies)]
    for ratio in result.ratios:
        cells = [fmt.format(value(result.get(s, ratio))) for s in result.strategies]
        lines.append(f"| {100 * ratio:.0f}% | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def validation_table(result: PlacementBenchResult) -> str:
    if not result.validation:
        return ""
    runs = result.validation[0].get("runs", "?")
    lines = ["**Cost-model validation: GPU tier on this CPU (profile this-cpu), estimate vs measurement of the same "
             f"configuration** (measured: each pass's fastest time over {runs} interleaved runs, summed; the "
             "fastest whole run beside it)", "",
             "| strategy | ratio | measured s | fastest run s | estimated s | measured out tok/s | "
             "estimated out tok/s | error | within tolerance |", "|---|---|---|---|---|---|---|---|---|"]
    for v in result.validation:
        lines.append(f"| {v['strategy']} | {v['ratio']:.2f} | {v['measured_seconds']:.2f} | "
                     f"{v.get('measured_fastest_run_seconds', float('nan')):.2f} | {v['estimated_seconds']:.2f} | "
                     f"{v['measured_output_tokens_per_s']:.1f} | {v['estimated_output_tokens_per_s']:.1f} | "
                     f"{100 * v['relative_error']:+.1f}% | {'yes' if v['within_tolerance'] else 'NO'} |")
    return "\n".join(lines)


def timed_table(result: PlacementBenchResult) -> str:
    """The cells served on this CPU in alternating rounds: median output tokens/s (spread) per strategy and ratio."""
    if not result.timed:
        return ""
    strategies = list(dict.fromkeys(t["strategy"] for t in result.timed))
    ratios = sorted({t["ratio"] for t in result.timed})
    by = {(t["strategy"], t["ratio"]): t for t in result.timed}
    rounds = len(result.timed[0]["rounds_output_tokens_per_s"])
    title = (f"**Output tokens/s measured on this CPU: median of {rounds} alternating rounds (spread = fastest - "
             "slowest), hit rate, swaps**")
    lines = [title, "", "| GPU Expert Ratio | " + " | ".join(strategies) + " |", "|---|" + "---|" * len(strategies)]

    def cell(t: dict | None) -> str:
        if t is None:
            return "-"
        return (f"{t['median_output_tokens_per_s']:.2f} ({t['spread_output_tokens_per_s']:.2f}), "
                f"{100 * t['hit_rate']:.1f}%, {t['swaps']}")

    for ratio in ratios:
        lines.append(f"| {100 * ratio:.0f}% | " + " | ".join(cell(by.get((s, ratio))) for s in strategies) + " |")
    return "\n".join(lines)


def markdown(result: PlacementBenchResult) -> str:
    parts = [table(result, value, fmt, f"{title} ({how(result, kind)})") for title, kind, value, fmt in FIELDS]
    check = validation_table(result)
    if check:
        parts.append(check)
    timed = timed_table(result)
    if timed:
        parts.append(timed)
    threshold = result.setup.get("prefill_threshold")
    if threshold:
        parts.append(f"Layerwise GPU prefill (--prefill-threshold {threshold}): dynamic and adaptive run every expert "
                     f"of a pass of at least {threshold} prompt tokens on the GPU, streaming the CPU tier's; the "
                     "static strategies never do.")
    adaptive = result.setup.get("adaptive")
    if adaptive:  # which settings the adaptive column ran with, those that differ from the defaults first
        parts.append(adaptive_line(adaptive))
    routing = result.setup.get("routing", {})
    if routing.get("source") == "trace":  # the model's routers replayed a real model's routing
        parts.append(f"Routing from the trace {routing['trace']} (its layers {routing['trace_layers']} for the "
                     f"model's MoE layers; {routing['rows_from_trace']} rows routed by the trace, "
                     f"{routing['rows_from_the_model']} by the model's own routers: warm-up and other rows the trace "
                     f"does not hold); calibration: {routing['calibration']}.")
    return "\n\n".join(parts) + "\n"


def adaptive_line(settings: dict) -> str:
    """One line naming the adaptive strategy's settings (tiermoe.config.AdaptiveSettings fields), the ones the run
    changed from the defaults first."""
    defaults = asdict(AdaptiveSettings().for_ranks(1))
    changed = [f"{k}={v}" for k, v in settings.items() if defaults.get(k) != v]
    kept = [f"{k}={v}" for k, v in settings.items() if defaults.get(k) == v]
    if not changed:
        return f"Adaptive settings: the defaults ({', '.join(kept)})."
    return f"Adaptive settings: {', '.join(changed)}" + (f" (the rest as default: {', '.join(kept)})." if kept else ".")
