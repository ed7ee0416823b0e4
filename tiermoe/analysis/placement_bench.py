"""`tiermoe bench placement`: the strategies x GPU-expert-ratio table, measured on CUDA, estimated elsewhere.

1. Load the model once (every expert on the CPU tier) and build two workloads from one dataset: a calibration
   split, whose routing statistics feed frequency / balanced / dynamic / adaptive, and a held-out split to serve,
   `concurrency` requests in flight (placement_workload, workload_runs).
2. Measure the CPU tier's backend on the model's real experts: a x distinct + b x pairs + c (tier_time_fit).
3. With CUDA: serve the held-out workload end to end for every (strategy, ratio) (placement_live). Done.
4. Without CUDA: record one per_token trace of the held-out workload (routing does not depend on placement),
   so every placement's hit rate, CPU expert reads and copies are exact (placement_traffic); count the model's
   work per pass (model_op_count); measure this CPU as a device (device_profile), the host's cost per dispatched op
   (host_cost_fit) and the GPU tier on this CPU (tier_time_fit); fit the host's per-step and per-sequence costs on
   timed runs at the calibration ratios (host_cost_fit); then estimate every cell's time with the cost model
   (tiermoe.placement.pass_cost, which the adaptive strategy also decides with) and the chosen GPU profile.
   With `this-cpu` the GPU tier really is this CPU: one more calibration run at a split (contention_ratio)
   measures what a layer costs beyond its two tiers when both compute on this CPU, the configurations at the
   validation ratios are served and timed beside the calibration runs (placement_lockstep), and estimate and
   measurement are compared (nothing is fitted on them: the check can fail).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tiermoe.analysis.core_split import caller_threads, core_split
from tiermoe.analysis.device_profile import measure_profile
from tiermoe.analysis.host_cost_fit import (
    fit_host_costs,
    fit_this_cpu,
    measure_op_seconds,
)
from tiermoe.analysis.model_op_count import measure_model_costs
from tiermoe.analysis.placement_live import measure_configuration
from tiermoe.analysis.placement_lockstep import time_configurations
from tiermoe.analysis.placement_result import Cell, PlacementBenchResult
from tiermoe.analysis.placement_rounds import time_in_rounds
from tiermoe.analysis.placement_traffic import (
    BENCH_STRATEGIES,
    DYNAMIC_STRATEGIES,
    pass_shapes,
    placement_traffic,
    strategy_mask,
)
from tiermoe.analysis.placement_workload import (
    Workload,
    WorkloadSpec,
    build_workloads,
    prompt_encoder,
)
from tiermoe.analysis.tier_time_fit import measure_cpu_tier, measure_gpu_tier
from tiermoe.analysis.trace_workload import RoutingTraceSpec, trace_workloads
from tiermoe.analysis.workload_runs import (
    RunTiming,
    make_engine,
    record_statistics,
    record_trace,
    ttft_summary,
    warm_up,
)
from tiermoe.config import AdaptiveSettings, CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.errors import TiermoeError
from tiermoe.layers.trace_routing import install_trace_routing
from tiermoe.placement.pass_cost import HostCosts, PassCostModel, expert_cost_model
from tiermoe.placement.pass_traffic import PassShapes, static_traffic
from tiermoe.placement.profiles import load_profile
from tiermoe.placement.tier_time import TierFit

THIS_CPU = "this-cpu"
DEFAULT_RATIOS = tuple(i / 10 for i in range(11))


@dataclass(frozen=True)
class PlacementBenchConfig:
    """Everything `tiermoe bench placement` takes. gpu_device None: cuda:0 when CUDA is available (measured),
    else the CPU (estimated). prefill_threshold: layerwise GPU prefill of the dynamic strategies (KTransformers'
    dynamic update fires after such batches; adaptive gets the same prefill, as a user serving it with
    --kt-gpu-prefill-token-threshold would, so the two columns differ by their placement only; None: off; the
    static strategies never have it, as in KTransformers' table). `adaptive`: the settings of the adaptive strategy
    (the `adaptive` placement policy, whose swaps the column shows; tiermoe.config.AdaptiveSettings)."""

    workload: WorkloadSpec
    model: str | Path | None = None
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    strategies: tuple[str, ...] = BENCH_STRATEGIES
    gpu_profile: str = "rtx4090"
    gpu_device: str | None = None
    concurrency: int = 8
    prefill_chunk: int = 512
    prefill_threshold: int | None = 512
    repeats: int = 3
    calibration_ratios: tuple[float, ...] = (0.0, 1.0)
    contention_ratio: float = 0.75  # the calibration split that measures the both-tiers cost (host_cost_fit)
    validation_ratios: tuple[float, ...] = (0.25, 0.5)
    validation_strategies: tuple[str, ...] = ("uniform", "frequency")
    tolerance: float = 0.15
    cpu: CPUConfig = CPUConfig()
    dtype: torch.dtype | None = None
    seed: int = 42  # random strategy
    routing_trace: RoutingTraceSpec | None = None  # the model's routers pick this trace's experts (trace_workload)
    adaptive: AdaptiveSettings = AdaptiveSettings()
    # this-cpu: strategies also served end to end at `timed_ratios` (default: the ratios strictly between 0 and 1),
    # `repeats` alternating rounds, a median and a spread per cell (placement_rounds)
    timed_strategies: tuple[str, ...] = ()
    timed_ratios: tuple[float, ...] | None = None

    def __post_init__(self):
        unknown = [s for s in (*self.strategies, *self.validation_strategies) if s not in BENCH_STRATEGIES]
        if unknown:
            raise TiermoeError(f"unknown strategies {unknown}; choose from {', '.join(BENCH_STRATEGIES)}")
        if not self.ratios or any(not 0.0 <= r <= 1.0 for r in (*self.ratios, *self.calibration_ratios,
                                                                 *self.validation_ratios)):
            raise TiermoeError("ratios must be between 0.0 and 1.0")
        unknown = [s for s in self.timed_strategies if s not in BENCH_STRATEGIES]
        if unknown:
            raise TiermoeError(f"unknown timed strategies {unknown}; choose from {', '.join(BENCH_STRATEGIES)}")
        if self.timed_strategies and self.gpu_profile != THIS_CPU:
            raise TiermoeError("timed strategies are served on this CPU: they go with --gpu-profile this-cpu")
        if any(not 0.0 <= r <= 1.0 for r in self.timed_ratios or ()):
            raise TiermoeError("timed ratios must be between 0.0 and 1.0")
        dynamic = [s for s in self.validation_strategies if s in DYNAMIC_STRATEGIES]
        if dynamic:
            raise TiermoeError(f"validation strategies must be static placements, not {dynamic}")
        calibrated_on = {*self.calibration_ratios, self.contention_ratio}
        if calibrated_on & set(self.validation_ratios):
            raise TiermoeError("calibration and validation ratios must differ: nothing is fitted on what is checked")
        if self.concurrency < 1 or self.prefill_chunk < 1 or self.repeats < 1:
            raise TiermoeError("concurrency, prefill_chunk and repeats must be >= 1")
        if self.prefill_threshold is not None and self.prefill_threshold < 1:
            raise TiermoeError(f"prefill_threshold must be >= 1 token, got {self.prefill_threshold}")
        if not 0 < self.tolerance < 1:
            raise TiermoeError(f"tolerance must be between 0 and 1, got {self.tolerance}")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_placement_bench(config: PlacementBenchConfig, log=_stderr,
                        workloads: tuple[Workload, Workload] | None = None) -> PlacementBenchResult:
    """Run the benchmark. workloads: (calibration, held-out) token-id workloads to use instead of the dataset's
    (for models without a tokenizer, e.g. make-model checkpoints)."""

    this_cpu = config.gpu_profile == THIS_CPU
    target = None if this_cpu else load_profile(config.gpu_profile)
    device = "cpu" if this_cpu else (config.gpu_device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    measured = torch.device(device).type == "cuda"
    log(f"[placement] loading the model (GPU tier on {device}; "
        f"{'throughput measured end to end' if measured else 'throughput ESTIMATED with the cost model'})")
    with LLM(config.model, gpu_device=device, dtype=config.dtype, cpu=config.cpu, progress=False) as llm:
        calibration_LE = None
        if config.routing_trace is not None:
            traced = trace_workloads(config.routing_trace, llm.hybrid.spec, llm.hybrid.config.vocab_size,
                                     config.workload.num_prompts, config.workload.calibration_prompts, device)
            install_trace_routing(llm.hybrid, traced.routing)
            log(f"[placement] routing from {config.routing_trace.path}: the model's MoE layers "
                f"{list(llm.hybrid.spec.moe_layers)} replay the trace's layers {list(traced.layers)}")
            workloads = (traced.calibration or traced.heldout, traced.heldout)
            calibration_LE = traced.calibration_LE
        calibration_wl, heldout_wl = workloads or build_workloads(config.workload, prompt_encoder(llm))
        if calibration_LE is None:
            log(f"[placement] calibration split: {calibration_wl.describe()}")
        else:
            log(f"[placement] calibration statistics: {config.routing_trace.calibration}")
        log(f"[placement] held-out split:    {heldout_wl.describe()}; {config.concurrency} requests in flight")
        warm_up(llm, heldout_wl, config.concurrency, config.prefill_chunk)
        if calibration_LE is None:
            log("[placement] recording statistics on the calibration split")
            calibration_LE = record_statistics(llm, calibration_wl, config.concurrency, config.prefill_chunk)
        log("[placement] measuring the CPU backend on the model's experts (a x distinct + b x pairs + c)")
        cpu_fit = measure_cpu_tier(llm.hybrid)
        log(f"[placement]   a = {cpu_fit.per_expert * 1e6:.1f} us/expert, b = {cpu_fit.per_pair * 1e6:.2f} us/pair, "
            f"c = {cpu_fit.per_call * 1e6:.1f} us/call (fit error {cpu_fit.mean_relative_error:.1%})")
        setup = _setup(llm, config, calibration_wl, heldout_wl, device)
        if measured:
            cells = _measure_all(llm, heldout_wl, calibration_LE, config, target, cpu_fit, log)
            result = PlacementBenchResult("measured", list(config.ratios), list(config.strategies), cells, setup,
                                          target.as_dict(), {"cpu_backend": cpu_fit.as_dict()})
        else:
            split = core_split(config.cpu)
            setup["cores"] = split.as_dict()
            with caller_threads(split):
                result = _estimate_all(llm, heldout_wl, calibration_LE, config, target, cpu_fit, setup, log)
        setup["routing"] = _routing_setup(llm, config.routing_trace)  # once every run has been routed
        return result


def _estimate_all(llm, workload: Workload, calibration_LE, config: PlacementBenchConfig, target, cpu_fit,
                  setup: dict, log) -> PlacementBenchResult:
    hybrid = llm.hybrid
    spec = hybrid.spec
    log("[placement] recording the held-out workload's routing (per_token trace)")
    shapes = pass_shapes(record_trace(llm, workload, config.concurrency, config.prefill_chunk))
    log(f"[placement]   {shapes.num_passes} forward passes")
    log("[placement] measuring this CPU as a GPU tier (bandwidth, flops, copies, launch) and counting the model's ops")
    raw_profile = measure_profile("cpu", spec.hidden_size, spec.expert_intermediate_size, hybrid.expert_dtype,
                                  spec.total_routed_experts * spec.bytes_per_expert(hybrid.expert_dtype),
                                  name=THIS_CPU)
    costs = measure_model_costs(llm, lambda m: make_engine(m, 1, config.prefill_chunk))
    op = measure_op_seconds(next(iter(hybrid.blocks.values())).gpu_tier.act, "cpu")
    gpu_fit = _time_gpu_tier(hybrid)
    log(f"[placement]   {op * 1e6:.2f} us per dispatched op; the GPU tier on this CPU: {gpu_fit.per_expert * 1e6:.1f} "
        f"us/expert, {gpu_fit.per_pair * 1e6:.2f} us/pair; one matrix streams at "
        f"{raw_profile.memory_bandwidth / 1e9:.1f} GB/s, computes {raw_profile.compute_flops / 1e9:.0f} GFLOP/s")
    on_host = PassCostModel(raw_profile, costs, cpu_fit, HostCosts(op, 0.0, 0.0), device_is_host=True,
                            tiers_overlap=False, gpu_tier=gpu_fit)
    split = (config.contention_ratio,) if target is None else ()  # both tiers on this CPU: only for this-cpu
    calibration = [("uniform", r) for r in (*config.calibration_ratios, *split)]
    validation_configs = [(s, r) for s in config.validation_strategies for r in config.validation_ratios]
    timed = time_configurations(llm, workload, calibration + (validation_configs if target is None else []),
                          calibration_LE, config, on_host, log)
    runs = []
    for strategy, ratio in calibration:
        timing = timed[(strategy, ratio)]  # per-pass fastest times
        if len(timing.step_seconds) != shapes.num_passes:
            raise TiermoeError(f"a timed run took {len(timing.step_seconds)} steps where the trace has "
                               f"{shapes.num_passes} passes; the workload's batches are not reproducible")
        mask = strategy_mask(strategy, spec.moe_row_mask(), spec.num_experts, ratio, None)[list(spec.moe_layers)]
        runs.append((f"{strategy}@{ratio:g}", static_traffic(shapes, mask), timing.step_seconds))
    host = fit_host_costs(on_host, shapes, runs).host  # carried to a GPU profile's estimate
    on_host = fit_this_cpu(on_host, shapes, runs)  # the GPU tier on this CPU: the forward's estimate corrected
    both = "" if target is not None else (
        f"; a MoE layer with both tiers busy costs {on_host.both_tiers_seconds * 1e6:+.0f} us beyond the two "
        f"(fitted on uniform@{config.contention_ratio:g})")
    log(f"[placement]   host: {host.op_seconds * 1e6:.2f} us per op, {host.step_seconds * 1e3:.2f} ms per step, "
        f"{host.sequence_seconds * 1e3:.2f} ms per sequence in a step{both}; the forward on this CPU "
        f"{on_host.forward_correction_seconds * 1e3:+.1f} ms a step against its estimate")
    model = on_host if target is None else PassCostModel(target, costs, cpu_fit, host, device_is_host=False)
    validation = []
    if target is None:
        validation = [_compare(on_host, shapes, workload, s, r, timed[(s, r)], calibration_LE, config, log)
                      for s, r in validation_configs]
    timed = []
    if config.timed_strategies:
        ratios = config.timed_ratios or tuple(r for r in config.ratios if 0.0 < r < 1.0)
        log(f"[placement] timing {', '.join(config.timed_strategies)} at {len(ratios)} ratios in {config.repeats} "
            "alternating rounds")
        timed = time_in_rounds(llm, workload, [(s, r) for r in ratios for s in config.timed_strategies],
                               calibration_LE, config, on_host, log)
    cells = []
    for ratio in config.ratios:
        for strategy in config.strategies:
            cells.append(estimate_cell(model, shapes, workload, strategy, ratio, calibration_LE, config))
        log(f"[placement] estimated ratio {ratio:.2f}: " + ", ".join(
            f"{c.strategy} {c.output_tokens_per_s:.1f}" for c in cells[-len(config.strategies):]) + " out tok/s")
    info = {"cpu_backend": cpu_fit.as_dict(), "gpu_tier_on_this_cpu": gpu_fit.as_dict(), "host": host.as_dict(),
            "model": costs.as_dict(),
            "this_cpu_profile": raw_profile.as_dict(),
            "passes": shapes.num_passes,
            "both_tiers_seconds": on_host.both_tiers_seconds,
            "forward_correction_seconds": on_host.forward_correction_seconds,
            "this_cpu_host": on_host.host.as_dict()}
    return PlacementBenchResult("estimated", list(config.ratios), list(config.strategies), cells, setup,
                                model.profile.as_dict(), info, validation, timed)


def _time_gpu_tier(hybrid) -> TierFit:
    """Time the GPU tier on the CPU device with every expert on it (a, b, c as for the CPU tier), then put the
    experts back where they were."""
    spec = hybrid.spec
    original = hybrid.mask
    try:
        hybrid.apply_mask(spec.moe_row_mask()[:, None].expand(-1, spec.num_experts).clone())
        return measure_gpu_tier(hybrid)
    finally:
        hybrid.apply_mask(original)


def estimate_cell(model: PassCostModel, shapes: PassShapes, workload: Workload, strategy: str, ratio: float,
                  calibration_LE, config: PlacementBenchConfig) -> Cell:
    """One cell from the trace and the cost model."""
    threshold = config.prefill_threshold if strategy in DYNAMIC_STRATEGIES else None
    traffic = placement_traffic(shapes, strategy, ratio, calibration_LE, model, threshold, config.adaptive,
                                seed=config.seed, tokens_per_pass=config.concurrency)
    seconds_P = model.pass_seconds_P(shapes, traffic)
    seconds = float(seconds_P.sum())
    bpe = model.model.bytes_per_expert
    return Cell(strategy, ratio, True, traffic.hit_rate, traffic.cpu_expert_reads() * bpe / workload.output_tokens,
                traffic.copied_experts() * bpe, traffic.swaps(), seconds, workload.output_tokens / seconds,
                (workload.prompt_tokens + workload.output_tokens) / seconds,
                ttft_summary(ttft_seconds(shapes, seconds_P)))


def ttft_seconds(shapes: PassShapes, seconds_P: torch.Tensor) -> list[float]:
    """Per request: from the start of its first pass to the end of the pass that samples its first token."""
    end = torch.cumsum(seconds_P, 0)
    start = end - seconds_P
    return (end[shapes.first_token_pass_R] - start[shapes.first_pass_R]).tolist()


def _compare(model: PassCostModel, shapes, workload, strategy, ratio, timing: RunTiming, calibration_LE, config,
             log) -> dict:
    """Estimate one configuration and compare with its measurement (nothing was fitted on it). The measurement
    is the sum of each pass's fastest time over the runs (placement_lockstep.time_configurations); the fastest
    whole run is reported beside it."""
    cell = estimate_cell(model, shapes, workload, strategy, ratio, calibration_LE, config)
    measured = sum(timing.step_seconds)
    error = cell.seconds / measured - 1
    ok = abs(error) <= config.tolerance
    log(f"[placement] validation {strategy} @ {ratio:.2f}: measured {measured:.2f} s (fastest run "
        f"{timing.wall_seconds:.2f} s), estimated {cell.seconds:.2f} s ({error:+.1%}) {'ok' if ok else 'FAIL'}")
    return {"strategy": strategy, "ratio": ratio, "measured_seconds": measured,
            "measured_fastest_run_seconds": timing.wall_seconds, "estimated_seconds": cell.seconds,
            "measured_output_tokens_per_s": workload.output_tokens / measured,
            "estimated_output_tokens_per_s": cell.output_tokens_per_s,
            "measured_ttft_mean_seconds": timing.ttft_summary()["mean"],
            "estimated_ttft_mean_seconds": cell.ttft_seconds["mean"], "relative_error": error,
            "within_tolerance": ok, "tolerance": config.tolerance, "runs": config.repeats,
            "error_vs_fastest_run": cell.seconds / timing.wall_seconds - 1}


def _measure_all(llm, workload, calibration_LE, config, profile, cpu_fit: TierFit, log) -> list[Cell]:
    spec = llm.hybrid.spec
    bpe = spec.bytes_per_expert(llm.hybrid.expert_dtype)
    cost = expert_cost_model(bpe, 2.0 * spec.params_per_expert, profile, cpu_fit)  # what adaptive decides with
    cells = []
    for ratio in config.ratios:
        for strategy in config.strategies:
            timing, traffic = measure_configuration(llm, workload, strategy, ratio, calibration_LE, config.concurrency,
                                                    config.prefill_chunk, config.prefill_threshold, cost, config.seed,
                                                    adaptive=config.adaptive)
            cells.append(Cell(strategy, ratio, False, traffic["gpu_pairs"] / max(1, traffic["pairs"]),
                              traffic["cpu_expert_reads"] * bpe / timing.output_tokens,
                              traffic["swap_bytes"] + traffic["streamed_experts"] * bpe, traffic["swaps"],
                              timing.wall_seconds, timing.output_tokens_per_s, timing.total_tokens_per_s,
                              timing.ttft_summary()))
            log(f"[placement] measured {strategy} @ {ratio:.2f}: {timing.output_tokens_per_s:.1f} out tok/s, "
                f"hit rate {cells[-1].hit_rate:.1%}")
    return cells


def _setup(llm, config: PlacementBenchConfig, calibration: Workload, heldout: Workload, device: str) -> dict:
    spec = llm.hybrid.spec
    if config.routing_trace is not None:  # the prompts are placeholders: the trace's routing is the workload
        dataset = f"routing trace {Path(config.routing_trace.path).name}"
    else:
        dataset = config.workload.dataset if calibration.prompt_names else "token-id workloads"
    return {
        "model": str(llm.model_dir), "model_name": Path(llm.model_dir).name, "model_type": spec.model_type,
        "moe_layers": spec.num_moe_layers, "experts": spec.num_experts, "top_k": spec.top_k,
        "bytes_per_expert": spec.bytes_per_expert(llm.hybrid.expert_dtype),
        "expert_dtype": str(llm.hybrid.expert_dtype).removeprefix("torch."),
        "dataset": dataset, "workload": asdict(config.workload),
        "calibration_workload": calibration.describe(), "heldout_workload": heldout.describe(),
        "prompt_tokens": heldout.prompt_tokens, "output_tokens": heldout.output_tokens,
        "concurrency": config.concurrency, "prefill_chunk": config.prefill_chunk,
        "prefill_threshold": config.prefill_threshold, "gpu_device": device, "cpu_backend": config.cpu.backend,
        "torch_threads": torch.get_num_threads(), "repeats": config.repeats,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        # what the adaptive column ran with (one process: cross-layer resolved as it ran)
        "adaptive": asdict(config.adaptive.for_ranks(1)) if "adaptive" in config.strategies else None,
    }


def _routing_setup(llm, trace: RoutingTraceSpec | None) -> dict:
    """Where the routing came from: the model's own routers, or a trace (which of its layers, what calibrated)."""
    if trace is None:
        return {"source": "the model's routers"}
    routing = llm.hybrid.routing_override
    return {"source": "trace", "trace": trace.path, "calibration": trace.calibration or "the trace's even requests",
            "trace_layers": list(routing.trace_layers),
            "rows_from_trace": routing.rows_routed, "rows_from_the_model": routing.rows_own}
