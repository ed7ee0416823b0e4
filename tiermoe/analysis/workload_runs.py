"""Serving a workload the way a server sees it, and timing it: every step, every request's first token.

All requests are queued at once and the engine keeps at most `concurrency` of them running (SGLang's
bench_serving with `--max-concurrency`): a request enters when another leaves, so the batch stays full of a mix
of prefilling and decoding sequences. Time to first token counts from the step that admits a request (the
moment a concurrency-limited client would send it) to the end of the step that samples its first token.
Steps are timed one by one, so the same run feeds throughput, TTFT and the per-pass cost-model calibration.
The same serving loop records the calibration statistics and the held-out trace (with a recorder attached).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tiermoe.analysis.device_profile import synchronizer
from tiermoe.analysis.placement_workload import Workload
from tiermoe.engine.engine import Engine, EngineConfig
from tiermoe.engine.sampling import SamplingParams
from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.recorders import make_recorder
from tiermoe.stats.recording import NO_RECORDER


@dataclass
class RunTiming:
    """One run of a workload. step_seconds[p] is forward pass p (the trace's pass p for the same workload)."""

    wall_seconds: float
    step_seconds: list[float]
    ttft_seconds: list[float]  # per request, in workload order
    prompt_tokens: int
    output_tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_seconds

    def ttft_summary(self) -> dict:
        return ttft_summary(self.ttft_seconds)


def ttft_summary(ttft: list[float]) -> dict:
    """Mean, median and p99 of times to first token, in seconds."""
    ordered = sorted(ttft)
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered),
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def make_engine(llm, concurrency: int, prefill_chunk: int, recorder=NO_RECORDER) -> Engine:
    """A fresh engine on an already loaded model (`tiermoe.LLM`), so each configuration starts clean; without
    prefix reuse, so every configuration computes (and routes) every token of its workload."""
    return Engine(llm.hybrid, llm.engine.eos_token_ids, llm.engine.detokenize,
                  EngineConfig(max_running=concurrency, prefill_chunk=prefill_chunk,
                               max_total_tokens=llm.engine.pool.tokens, prefix_cache=False), recorder)


class WorkloadRun:
    """Serving `workload` on `engine` one timed step at a time (greedy, EOS ignored, each request its own output
    length). Times run on the run's own clock, the sum of its steps, so several runs can be stepped in turn
    (placement_lockstep) and each still sees only its own time."""

    def __init__(self, engine: Engine, workload: Workload):
        self.engine, self.workload = engine, workload
        self.seqs = [engine.add(list(ids), SamplingParams(max_tokens=n, ignore_eos=True))
                     for ids, n in zip(workload.prompt_ids, workload.output_lens)]
        self._index = {s.seq_id: i for i, s in enumerate(self.seqs)}
        routing = getattr(engine.hybrid, "routing_override", None)  # tiermoe.layers.trace_routing
        if routing is not None:
            routing.assign(engine, {s.seq_id: r for s, r in zip(self.seqs, workload.trace_requests)})
        self._admitted: dict[int, float] = {}
        self.ttft = [0.0] * len(self.seqs)
        self.steps: list[float] = []
        self.clock = 0.0  # seconds of this run's own steps
        self.done = 0
        self._synchronize = synchronizer(engine.hybrid.gpu_device)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        waiting = {s.seq_id for s in self.engine.waiting}
        before = time.perf_counter()
        produced = self.engine.step()
        self._synchronize()
        seconds = time.perf_counter() - before
        start, self.clock = self.clock, self.clock + seconds
        self.steps.append(seconds)
        for seq in self.engine.running + produced:
            if seq.seq_id not in self._admitted and seq.seq_id in self._index and seq.seq_id in waiting:
                self._admitted[seq.seq_id] = start  # it left the queue in this step's admission
        for seq in produced:
            if len(seq.output_ids) == 1:
                self.ttft[self._index[seq.seq_id]] = self.clock - self._admitted.get(seq.seq_id, 0.0)
            self.done += seq.finished

    def timing(self, wall_seconds: float | None = None) -> RunTiming:
        """The run's timing; wall_seconds defaults to its own clock (the sum of its steps)."""
        return RunTiming(self.clock if wall_seconds is None else wall_seconds, self.steps, self.ttft,
                         self.workload.prompt_tokens, sum(len(s.output_ids) for s in self.seqs))


def run_workload(engine: Engine, workload: Workload, on_step: Callable[[int, int], None] | None = None) -> RunTiming:
    """Serve every request of `workload` to completion, alone; wall time measured around the whole loop."""
    run = WorkloadRun(engine, workload)
    start = time.perf_counter()
    while run.has_work():
        run.step()
        if on_step is not None:
            on_step(run.done, len(run.seqs))
    return run.timing(time.perf_counter() - start)


def serve(llm, workload: Workload, concurrency: int, prefill_chunk: int, recorder=NO_RECORDER) -> RunTiming:
    """Serve `workload` on a fresh engine (with `recorder` watching), closing the engine afterwards."""
    engine = make_engine(llm, concurrency, prefill_chunk, recorder)
    try:
        return run_workload(engine, workload)
    finally:
        engine.close()


def record_statistics(llm, workload: Workload, concurrency: int, prefill_chunk: int) -> torch.Tensor:
    """Routing counts [L, E] (float64) of serving `workload` (SGLang's stat mode)."""
    recorder = make_recorder("stat", ModelShape.of(llm.hybrid.spec), -1)
    serve(llm, workload, concurrency, prefill_chunk, recorder)
    return recorder.dump()["logical_count"].sum(dim=0).to(torch.float64)


def record_trace(llm, workload: Workload, concurrency: int, prefill_chunk: int) -> dict:
    """A per_token trace of serving `workload` (tiermoe.stats.traces format)."""
    recorder = make_recorder("per_token", ModelShape.of(llm.hybrid.spec), -1)
    serve(llm, workload, concurrency, prefill_chunk, recorder)
    return recorder.dump()


def warm_up(llm, workload: Workload, concurrency: int, prefill_chunk: int) -> None:
    """A few short requests first: allocators, kernel caches and lazy initialisation are not timed."""
    n = min(workload.num_requests, concurrency)
    serve(llm, Workload("warm-up", workload.prompt_ids[:n], tuple(min(4, x) for x in workload.output_lens[:n]),
                        trace_requests=workload.trace_requests[:n]), concurrency, prefill_chunk)
