"""Timing several static placements of one workload side by side, pass by pass, on a machine shared with others.

The cost-model validation compares estimates with measured runs, and the host costs are fitted on measured runs;
on a shared machine the load of other processes comes and goes within seconds, so runs timed one after another
see different machines. Here every configuration has its own copy of the model (its experts already where that
placement puts them: moving experts between steps would cost more than the steps) and its own engine, and the runs
advance in turn, one engine step each (the order rotated every pass): pass p of every configuration is timed
within a fraction of a second of the others, under the same load. Over `repeats` rounds each pass keeps its
fastest time, so a burst of load that slows some passes of one round is dropped, for every configuration alike.
Each run's clock is the sum of its own steps (placement_runner.WorkloadRun), so TTFT and totals are its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tiermoe.benchmarking.placement_runner import RunTiming, WorkloadRun, make_engine
from tiermoe.benchmarking.placement_workload import Workload
from tiermoe.errors import TiermoeError


def time_in_lockstep(llms: dict, workload: Workload, concurrency: int, prefill_chunk: int, repeats: int,
                     log: Callable[[str], None]) -> dict:
    """llms: key -> a loaded model already placed as that configuration. Returns key -> RunTiming with each
    pass's fastest time over the rounds (see merge_runs)."""
    keys = list(llms)
    runs_by_key: dict = {k: [] for k in keys}
    for r in range(repeats):
        engines = {k: make_engine(llms[k], concurrency, prefill_chunk) for k in keys}
        try:
            runs = {k: WorkloadRun(engines[k], workload) for k in keys}
            p = 0
            while any(run.has_work() for run in runs.values()):
                for k in keys[p % len(keys):] + keys[:p % len(keys)]:
                    if runs[k].has_work():
                        runs[k].step()
                p += 1
        finally:
            for engine in engines.values():
                engine.close()
        for k in keys:
            runs_by_key[k].append(runs[k].timing())
        log(f"[placement] lockstep round {r + 1}/{repeats}: " + ", ".join(
            f"{_label(k)} {runs[k].clock:.2f} s" for k in keys))
    return {k: merge_runs(k, runs_by_key[k]) for k in keys}


def merge_runs(key, timings: list[RunTiming]) -> RunTiming:
    """The fastest run, with step_seconds replaced by each pass's fastest time over all runs (every run of a
    workload has the same passes)."""
    lengths = {len(t.step_seconds) for t in timings}
    if len(lengths) != 1:
        raise TiermoeError(f"runs of {_label(key)} took {sorted(lengths)} steps; the workload's batches are not "
                           "reproducible")
    best = min(timings, key=lambda t: t.wall_seconds)
    return replace(best, step_seconds=[min(steps) for steps in zip(*(t.step_seconds for t in timings))])


def _label(key) -> str:
    return f"{key[0]}@{key[1]:g}" if isinstance(key, tuple) and len(key) == 2 else str(key)
