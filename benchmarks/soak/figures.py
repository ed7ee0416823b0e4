"""The figures of the adversarial soak (benchmarks/soak_adversarial.py), each with its goal, and the markdown table
of their medians over the runs. A run's figures are a dict of floats; a goal reads the dict of medians (some
compare two figures)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    goal: str = "-"
    met: Callable[[dict], bool] | None = None
    fmt: str = "{:.0f}"


def _zero(key: str) -> Callable[[dict], bool]:
    return lambda r: r[key] == 0


FIGURES = [
    Figure("load", "machine load average (1 min) as the run began", fmt="{:.2f}"),
    Figure("streams alone", "well-behaved: streams completed, alone"),
    Figure("streams attack", "well-behaved: streams completed, under attack"),
    Figure("failed alone", "well-behaved: failed requests, alone (streams, malformed not 4xx)", "0",
           _zero("failed alone")),
    Figure("failed attack", "well-behaved: failed requests, under attack", "0", _zero("failed attack")),
    Figure("malformed attack", "well-behaved: malformed requests sent, under attack"),
    Figure("malformed 4xx attack", "... of them answered 4xx", "all",
           lambda r: r["malformed 4xx attack"] == r["malformed attack"]),
    Figure("ttft p50 alone", "TTFT p50, alone (s)", fmt="{:.3f}"),
    Figure("ttft p50 attack", "TTFT p50, under attack (s)", fmt="{:.3f}"),
    Figure("ttft p99 alone", "TTFT p99, alone (s)", fmt="{:.3f}"),
    Figure("ttft p99 attack", "TTFT p99, under attack (s)", fmt="{:.3f}"),
    Figure("ttft ratio", "TTFT p99 under attack / alone", "<= 3x", lambda r: r["ttft ratio"] <= 3, "{:.2f}x"),
    Figure("itl p50 alone", "inter-token latency p50, alone (ms)", fmt="{:.1f}"),
    Figure("itl p50 attack", "inter-token latency p50, under attack (ms)", fmt="{:.1f}"),
    Figure("itl p99 alone", "inter-token latency p99, alone (ms)", fmt="{:.1f}"),
    Figure("itl p99 attack", "inter-token latency p99, under attack (ms)", fmt="{:.1f}"),
    Figure("itl ratio", "inter-token latency p99 under attack / alone", "<= 2x", lambda r: r["itl ratio"] <= 2,
           "{:.2f}x"),
    Figure("rss alone", "server peak RSS, alone (MB)"),
    Figure("rss attack", "server peak RSS, under attack (MB)"),
    Figure("server cores alone", "server CPU, cores busy on average, alone", fmt="{:.2f}"),
    Figure("server cores attack", "server CPU, cores busy on average, under attack", fmt="{:.2f}"),
    Figure("clients cores alone", "well-behaved clients' process CPU, cores, alone", fmt="{:.2f}"),
    Figure("clients cores attack", "well-behaved clients' process CPU, cores, under attack", fmt="{:.2f}"),
    Figure("adv cores", "adversaries' process CPU, cores, under attack", fmt="{:.2f}"),
    Figure("fds alone", "server open descriptors (/proc/PID/fd), peak alone"),
    Figure("fds attack", "server open descriptors (/proc/PID/fd), peak under attack", "< its limit",
           lambda r: r["fds attack"] < r["files limit"]),
    Figure("files limit", "server's soft open-file limit (ulimit -n)"),
    Figure("health polls", "/health polls (every second, both phases)"),
    Figure("health failed", "/health failures (not 200 within 5 s)", "0", _zero("health failed")),
    Figure("health slowest", "/health slowest answer (s)", fmt="{:.3f}"),
    Figure("sigterm s", "SIGTERM to exit, every client gone (s)", "<= 10", lambda r: r["sigterm s"] <= 10, "{:.2f}"),
    Figure("exit status", "exit status after SIGTERM", "0", _zero("exit status")),
    Figure("adv idle open at ready", "adversary: idle connections open when the attack began"),
    Figure("adv idle connects", "adversary: idle connections made (they reconnect when closed)"),
    Figure("adv slow open at ready", "adversary: slow-body connections open when the attack began"),
    Figure("adv slow answered 408", "adversary: slow bodies answered 408"),
    Figure("adv long tokens", "adversary: long generation, tokens (usage; 0 if cut before its end)"),
    Figure("adv long chunks", "adversary: long generation, text chunks streamed"),
    Figure("adv long first gaps median ms", "adversary: long generation, median gap of its first 200 chunks (ms)",
           fmt="{:.1f}"),
    Figure("adv long last gaps median ms", "adversary: long generation, median gap of its last 200 chunks (ms)",
           fmt="{:.1f}"),
    Figure("adv score status 200", "adversary: scoring request answered 200 (of 1)"),
    Figure("adv score seconds", "adversary: scoring request, seconds", fmt="{:.1f}"),
    Figure("adv batch 200", "adversary: /generate batches answered 200"),
    Figure("adv batch 503 retry", "adversary: /generate batches answered 503 with Retry-After"),
    Figure("batch cut", "adversary: /generate batches still unanswered when the attack ended"),
    Figure("batch other", "adversary: /generate batches answered otherwise", "0",
           _zero("batch other")),
]


def medians(runs: list[dict]) -> dict:
    return {f.key: statistics.median(r.get(f.key, 0.0) for r in runs) for f in FIGURES}


def _cell(fmt: str, value: float) -> str:
    return "n/a" if math.isnan(value) else fmt.format(value)


def print_table(runs: list[dict], title: str) -> list[str]:
    """Print the markdown table of the medians; return the labels of the figures whose median missed its goal."""
    med = medians(runs)
    print(f"\n{title}\n")
    print("| figure | goal | median | min - max | met |")
    print("|---|---|---|---|---|")
    missed = []
    for f in FIGURES:
        values = [r.get(f.key, 0.0) for r in runs]
        met = "" if f.met is None else ("yes" if f.met(med) else "**NO**")
        if met == "**NO**":
            missed.append(f.label)
        spread = f"{_cell(f.fmt, min(values))} - {_cell(f.fmt, max(values))}"
        print(f"| {f.label} | {f.goal} | {_cell(f.fmt, med[f.key])} | {spread} | {met} |")
    return missed
