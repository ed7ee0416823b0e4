"""Timing several static placements of one workload side by side, pass by pass, on a machine shared with others.

The cost-model validation compares estimates with measured runs, and the host costs are fitted on measured runs;
on a shared machine the load of other processes comes and goes within seconds, so runs timed one after another
see different machines. Here every configuration has its own copy of the model (its experts already where that
placement puts them: moving experts between steps would cost more than the steps) and its own engine, and the runs
advance in turn, one engine step each (the order rotated every pass): pass p of every configuration is timed
within a fraction of a second of the others, under the same load. Over `repeats` rounds each pass keeps its
fastest time, so a burst of load that slows some passes of one round is dropped, for every configuration alike.
Each run's clock is the sum of its own steps (workload_runs.WorkloadRun), so TTFT and totals are its own.
Without memory for the copies (half the available memory), whole runs are interleaved in rotating rounds on the
one model instead, with the same per-pass minima.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace

from tiermoe.analysis.placement_live import measure_configuration
from tiermoe.analysis.placement_traffic import strategy_mask
from tiermoe.analysis.placement_workload import Workload
from tiermoe.analysis.workload_runs import RunTiming, WorkloadRun, make_engine, warm_up
from tiermoe.engine.llm import LLM
from tiermoe.errors import TiermoeError
from tiermoe.fit import available_ram
from tiermoe.layers.trace_routing import install_trace_routing
from tiermoe.model.gguf_checkpoint import weight_files


def time_configurations(llm, workload: Workload, configs: list[tuple[str, float]], calibration_LE, config, cost,
                        log: Callable[[str], None]) -> dict[tuple[str, float], RunTiming]:
    """Time every static (strategy, ratio) `config.repeats` times (config: a PlacementBenchConfig). Per
    configuration: the fastest run, with `step_seconds` replaced by each pass's fastest time over all runs, so a
    burst of load from other processes costs one run a few passes, not the measurement; calibration and
    validation both use these per-pass minima, so they are compared like for like. With memory for a copy of the
    model per configuration the runs advance in lockstep; else whole runs are interleaved in rotating rounds."""
    copies = len(configs) - 1
    need, have = copies * _model_bytes(llm.model_dir), _available_memory()
    if need > 0.5 * have:
        log(f"[placement] timing one configuration after another: {copies} more copies of the model "
            f"({need / 2**30:.1f} GiB) would not fit in half the available memory ({have / 2**30:.1f} GiB)")
        return _timed_rounds(llm, workload, configs, calibration_LE, config, cost, log)
    log(f"[placement] timing {len(configs)} configurations in lockstep ({config.repeats} rounds; "
        f"loading {copies} more copies of the model)")

    spec = llm.hybrid.spec
    with ExitStack() as stack:
        llms = {}
        for i, (strategy, ratio) in enumerate(configs):
            model = llm if i == 0 else stack.enter_context(
                LLM(config.model, gpu_device="cpu", dtype=config.dtype, cpu=config.cpu, progress=False))
            if i > 0 and llm.hybrid.routing_override is not None:  # the copies replay the same trace
                install_trace_routing(model.hybrid, llm.hybrid.routing_override)
            model.hybrid.apply_mask(strategy_mask(strategy, spec.moe_row_mask(), spec.num_experts, ratio,
                                                  calibration_LE, config.seed, cost, config.concurrency, spec.top_k))
            warm_up(model, workload, config.concurrency, config.prefill_chunk)
            llms[(strategy, ratio)] = model
        return time_in_lockstep(llms, workload, config.concurrency, config.prefill_chunk, config.repeats, log)


def _model_bytes(model_dir) -> int:
    return sum(f.stat().st_size for f in weight_files(model_dir))


def _available_memory() -> int:
    ram = available_ram()  # MemAvailable; where /proc has none, the free physical pages
    return ram if ram is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _timed_rounds(llm, workload, configs: list[tuple[str, float]], calibration_LE, config, cost, log
                  ) -> dict[tuple[str, float], RunTiming]:
    """Whole runs of every configuration, `repeats` rounds in rotating order, on the one loaded model."""
    runs: dict[tuple[str, float], list[RunTiming]] = {key: [] for key in configs}
    for r in range(config.repeats):
        for strategy, ratio in configs[r % len(configs):] + configs[:r % len(configs)]:
            timing, _ = measure_configuration(llm, workload, strategy, ratio, calibration_LE, config.concurrency,
                                              config.prefill_chunk, config.prefill_threshold, cost, config.seed)
            log(f"[placement] timed run {strategy} @ {ratio:.2f} (round {r + 1}/{config.repeats}): "
                f"{timing.wall_seconds:.2f} s, {timing.output_tokens_per_s:.1f} out tok/s")
            runs[(strategy, ratio)].append(timing)
    return {key: merge_runs(key, timings) for key, timings in runs.items()}


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
