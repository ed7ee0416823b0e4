"""tiermoe bench's runs: `placement` (every strategy x GPU ratio served, measured or estimated) and `dynamic`
(a trace replayed through every placement policy)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from tiermoe.analysis.dynamic_bench import (
    DEFAULT_RATIOS,
    format_table,
    replay_cost_model,
    run_dynamic_bench,
)
from tiermoe.analysis.placement_bench import PlacementBenchConfig, run_placement_bench
from tiermoe.analysis.placement_report import markdown
from tiermoe.analysis.placement_workload import WorkloadSpec
from tiermoe.analysis.trace_replay import trace_passes
from tiermoe.analysis.trace_workload import RoutingTraceSpec
from tiermoe.arch import detect, load_config
from tiermoe.bundled import resolve_model
from tiermoe.cli.adaptive_flags import adaptive_from_args, given_adaptive_flags
from tiermoe.cli.cpu_flags import cpu_from_args
from tiermoe.cli.extras import require_dataset_extra
from tiermoe.cli.plots import plot_bench, plot_placement_bench
from tiermoe.errors import TiermoeError
from tiermoe.placement.profiles import load_profile
from tiermoe.stats.io import load_counts, load_trace


def run(args) -> int:
    if args.bench == "placement":
        return run_placement(args)
    return run_dynamic(args)


def run_placement(args) -> int:
    if (args.dataset is None) == (args.routing_trace is None):
        raise TiermoeError("give --dataset (prompts the model routes itself) or --routing-trace (routing from a "
                           "trace), one of the two")
    if args.routing_trace is None and (args.routing_calibration or args.routing_layers):
        raise TiermoeError("--routing-calibration and --routing-layers go with --routing-trace")
    if args.dataset is not None:
        require_dataset_extra(args.dataset, "tiermoe bench placement")  # before a model loads
    given = given_adaptive_flags(args)
    if given and args.strategies and "adaptive" not in args.strategies:
        raise TiermoeError(f"{', '.join(given)} set the adaptive strategy's settings; they need adaptive in "
                           f"--strategies (given: {','.join(args.strategies)})")
    routing = None if args.routing_trace is None else RoutingTraceSpec(
        args.routing_trace, args.routing_calibration, args.routing_layers, args.seed)
    workload = WorkloadSpec(args.dataset or f"routing trace {args.routing_trace}", args.num_prompts,
                            args.calibration_prompts, args.output_len, args.max_prompt_tokens, args.heldout_fraction,
                            args.seed)
    options = {k: v for k, v in (("ratios", args.ratios), ("strategies", args.strategies)) if v}
    config = PlacementBenchConfig(
        workload, model=args.model, gpu_profile=args.gpu_profile, gpu_device=args.gpu_device,
        concurrency=args.concurrency, prefill_chunk=args.prefill_chunk,
        prefill_threshold=args.prefill_threshold or None, repeats=args.repeats, tolerance=args.tolerance,
        cpu=cpu_from_args(args), routing_trace=routing, adaptive=adaptive_from_args(args),
        timed_strategies=tuple(args.timed_strategies or ()),
        timed_ratios=tuple(args.timed_ratios) if args.timed_ratios else None,
        **{k: tuple(v) for k, v in options.items()})
    result = run_placement_bench(config)
    text = markdown(result)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.out:
        result.write_json(args.out)
    if args.plot:
        plot_placement_bench(result, args.plot)
    passed = result.validation_passed()
    if passed is False:
        print(f"cost-model validation FAILED: estimate and measurement differ by more than {args.tolerance:.0%}",
              file=sys.stderr)
        return 1
    return 0


def _model_dir(path: Path) -> Path:
    """A config.json alone stands for its directory, as in `tiermoe fit`: replay needs the shapes, no weights."""
    return path.parent if path.is_file() and path.name == "config.json" else path


def run_dynamic(args) -> int:
    gpu = load_profile(args.gpu_profile)  # flags: checked before the trace is read
    adaptive = adaptive_from_args(args, max_swaps=args.copy_budget).for_ranks(1)  # the replay is one process
    passes = trace_passes(load_trace(args.trace))
    spec = detect(load_config(_model_dir(resolve_model(args.model))))
    if (spec.num_layers, spec.num_experts) != (passes.num_layers, passes.num_experts):
        raise TiermoeError(f"the trace is of a {passes.num_layers} x {passes.num_experts} model, --model is "
                           f"{spec.num_layers} x {spec.num_experts}")
    calibration = load_counts(args.calibration, passes.num_layers, passes.num_experts) if args.calibration else None
    cost = replay_cost_model(spec, gpu, args.cpu_bandwidth_gbs * 1e9, args.cpu_gflops * 1e9)
    bench = run_dynamic_bench(passes, cost, args.ratios or DEFAULT_RATIOS, calibration, args.prefill_threshold,
                              copy_budget=args.copy_budget, adaptive=adaptive)
    if args.json:
        print(json.dumps({"gpu_profile": gpu.as_dict(), "passes": passes.num_passes, "adaptive": asdict(adaptive),
                          "rows": bench.rows}))
    else:
        print(f"{passes.num_passes} passes; GPU profile {gpu.name} (times are cost-model ESTIMATES)\n")
        print(format_table(bench, "hit_rate", "{:.1%}", "GPU hit rate (measured on the trace)"))
        print()
        print(format_table(bench, "estimated_output_tokens_per_s", "{:.1f}", "output tokens/s (ESTIMATE)"))
        print()
        print(format_table(bench, "bytes_copied", "{:.3g}", "bytes copied between tiers"))
    if args.plot:
        plot_bench(bench, args.plot, f"{args.trace}: {passes.num_passes} passes, {gpu.name} (estimates)")
    return 0
