"""tiermoe bench: placement benchmarks (`dynamic`: policies replayed on a trace; `placement`: the strategies x
GPU-expert-ratio table, measured on CUDA and estimated elsewhere)."""

from __future__ import annotations

import argparse
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
from tiermoe.analysis.placement_traffic import BENCH_STRATEGIES
from tiermoe.analysis.placement_workload import WorkloadSpec
from tiermoe.analysis.trace_replay import trace_passes
from tiermoe.analysis.trace_workload import RoutingTraceSpec
from tiermoe.arch import detect, load_config
from tiermoe.cli.adaptive_flags import (
    REPLAY,
    STRATEGY,
    adaptive_from_args,
    add_adaptive_flags,
    given_adaptive_flags,
)
from tiermoe.cli.cpu_flags import add_cpu_flags, cpu_from_args
from tiermoe.cli.flags import (
    add_command,
    fraction,
    non_negative_int,
    output_file,
    plot_file,
    positive_float,
    positive_int,
    seed_int,
)
from tiermoe.cli.plots import plot_bench, plot_placement_bench
from tiermoe.errors import TiermoeError
from tiermoe.models import resolve_model
from tiermoe.placement.cache_policies import DEFAULT_COPY_BUDGET
from tiermoe.placement.profiles import load_profile
from tiermoe.stats.io import load_counts, load_trace


def ratio_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of ratios") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"ratios must be between 0.0 and 1.0, got '{text}'")
    return values


def strategy_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [v for v in values if v not in BENCH_STRATEGIES]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"unknown strategies {unknown or text!r}; choose from "
                                         f"{','.join(BENCH_STRATEGIES)}")
    return values


def add_parser(sub) -> None:
    p = add_command(sub, "bench", "Placement benchmarks: `tiermoe bench placement` serves a dataset at every "
                    "strategy and GPU-expert ratio; `tiermoe bench dynamic` replays a per_token trace.",
                    "tiermoe bench placement --dataset sharegpt --plot placement.png",
                    "tiermoe bench dynamic --trace sharegpt.pt --calibration gsm8k.pt --plot dynamic.png")
    benches = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    d = add_command(
        benches, "dynamic",
        "Replay a per_token trace (tiermoe record --mode per_token, or a trace CSV) through every placement policy "
        "at each GPU ratio: the static strategies (time-balanced too), KT's dynamic update, LRU and LFU expert caches "
        "(--copy-budget swaps under way), adaptive, and the ceilings (Belady with the same copy budget, the trace's "
        "own static top-k, the per-request and per-window oracles): hit rate (measured on the trace), estimated time "
        "and tokens/s (cost model; copies charged in full), copy traffic. Swaps run as the engine runs them "
        "(demotion first, then promotion). Static strategies take their statistics from --calibration.",
        "tiermoe bench dynamic --trace held_out.pt --calibration calib.pt",
        "tiermoe bench dynamic --trace t.pt --calibration c.pt --ratios 0.1,0.25,0.5 --gpu-profile h200 --json",
        "tiermoe bench dynamic --trace law.csv --calibration intent_heat.csv --model DeepSeek-V2-Lite/config.json",
        "tiermoe bench dynamic --trace law.csv --calibration intent.csv --model DeepSeek-V2-Lite/config.json "
        "--no-adaptive-cross-layer --adaptive-swap-z 0 --adaptive-max-swaps 8",
    )
    d.prog = "tiermoe bench dynamic"
    d.add_argument("--trace", required=True, help="per_token trace to replay (.pt or trace CSV, docs/traces.md)")
    d.add_argument("--calibration", help="statistics, trace or heat CSV for frequency/balanced/adaptive (another "
                   "split)")
    d.add_argument("--model", help="checkpoint directory, GGUF, or a config.json alone, whose experts' bytes and FLOPs "
                   "(bf16) the cost model uses (default: the bundled model)")
    d.add_argument("--ratios", type=ratio_list, default=None, help="GPU expert ratios (default 0.1,...,0.9)")
    d.add_argument("--prefill-threshold", type=positive_int, default=None,
                   help="layerwise GPU prefill threshold for the dynamic policies (default: none)")
    d.add_argument("--copy-budget", type=non_negative_int, default=DEFAULT_COPY_BUDGET,
                   help=f"swaps the lru / lfu / belady caches may have under way at once (default "
                        f"{DEFAULT_COPY_BUDGET}; adaptive's --adaptive-max-swaps defaults to it)")
    d.add_argument("--gpu-profile", default="rtx4090", help="rtx4090 (default), h200, or a JSON file")
    d.add_argument("--cpu-bandwidth-gbs", type=positive_float, default=25.0,
                   help="CPU read bandwidth, GB/s (default 25)")
    d.add_argument("--cpu-gflops", type=positive_float, default=400.0,
                   help="CPU expert GFLOP/s at prefill (default 400)")
    d.add_argument("--json", action="store_true", help="print JSON with every figure (and the adaptive settings)")
    d.add_argument("--plot", type=plot_file, help="write hit rate and estimated tokens/s against ratio to this PNG")
    add_adaptive_flags(d, REPLAY)
    add_placement_parser(benches)


def add_placement_parser(benches) -> None:
    p = add_command(
        benches, "placement",
        "The placement table KTransformers publishes, for your model, machine and prompts: for every strategy and "
        "GPU-expert ratio the GPU-tier hit rate, CPU expert bytes per output token, expert bytes copied, output and "
        "total tokens/s and time to first token, serving a held-out split of DATASET with several requests in flight "
        "(statistics for frequency/balanced/dynamic/adaptive come from a separate calibration split). On CUDA the "
        "throughput is measured end to end. Without CUDA it is ESTIMATED: hit rates and traffic are exact (one "
        "recorded trace replayed through every placement), the CPU tier's time is measured on this machine, and a "
        "GPU profile gives the GPU share; `--gpu-profile this-cpu` profiles this CPU as the GPU tier, runs it there "
        "and checks estimate against measurement at ratios 0.25 and 0.5. The adaptive strategy is tiermoe's adaptive "
        "placement policy with the --adaptive-* settings below, which the JSON (setup.adaptive) and the tables "
        "record.",
        "tiermoe bench placement --dataset sharegpt --out placement.json --plot placement.png",
        "tiermoe bench placement --dataset sharegpt --gpu-profile this-cpu --ratios 0,0.25,0.5,0.75,1",
        "tiermoe bench placement --model /models/Qwen3-30B-A3B --dataset prompts.jsonl --gpu-profile h200 "
        "--strategies uniform,frequency,dynamic",
        "tiermoe make-model --arch deepseek_v2 --preset deepseek-v2-lite --layers 5 --out /tmp/dsv2l-5 && "
        "tiermoe bench placement --model /tmp/dsv2l-5 --routing-trace esft_law.csv --gpu-profile this-cpu",
        "tiermoe bench placement --dataset sharegpt --strategies frequency,adaptive --no-adaptive-cross-layer "
        "--adaptive-max-swaps 8",
    )
    p.prog = "tiermoe bench placement"
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--dataset", help="sharegpt, gsm8k, gpqa, chitchat, or a .json / .jsonl file (or --routing-trace)")
    p.add_argument("--routing-trace", help="serve this trace's requests (.pt or trace CSV, docs/traces.md) with the "
                   "model's routers picking the trace's experts per token and layer, instead of routing by the "
                   "model's weights: real expert sizes (a make-model checkpoint) with real routing; its top-k and "
                   "expert count must be the model's. Even requests calibrate, odd ones are served")
    p.add_argument("--routing-calibration", help="statistics of the trace model's shape (trace, heat CSV, .pt) to "
                   "place frequency/balanced/dynamic/adaptive with; then every trace request is served")
    p.add_argument("--routing-layers", type=layer_list, help="the trace's MoE layers (decoder indices) that the "
                   "model's MoE layers replay, in order (default: evenly spread from its first to its last)")
    p.add_argument("--num-prompts", type=positive_int, default=32, help="held-out requests to serve (default 32)")
    p.add_argument("--calibration-prompts", type=positive_int, default=64,
                   help="calibration requests whose routing statistics place frequency/balanced (default 64)")
    p.add_argument("--ratios", type=ratio_list, default=None, help="GPU expert ratios (default 0,0.1,...,1)")
    p.add_argument("--strategies", type=strategy_list, default=None,
                   help=f"comma-separated, from {','.join(BENCH_STRATEGIES)} (default: all)")
    p.add_argument("--gpu-profile", default="rtx4090",
                   help="rtx4090 (default), h200, this-cpu (measure this CPU as the GPU tier and validate the cost "
                        "model), or a JSON file (e.g. from benchmarks/gpu_check.sh: memory_bandwidth, compute_flops, "
                        "pcie_bandwidth, launch_overhead, fused_grouped_gemm: true where torch runs its grouped GEMM "
                        "as one kernel, compute capability 9.x)")
    p.add_argument("--gpu-device", default=None,
                   help="GPU tier device (default: cuda:0 when CUDA is available, else the CPU with estimates)")
    p.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight (default 8)")
    p.add_argument("--output-len", type=positive_int, default=64,
                   help="output tokens per request: each gets between half and all of it, seeded (default 64)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=512, help="skip longer prompts (default 512)")
    p.add_argument("--heldout-fraction", type=fraction, default=0.1,
                   help="share of conversations in the held-out split (default 0.1)")
    p.add_argument("--prefill-threshold", type=non_negative_int, default=512,
                   help="layerwise GPU prefill threshold of the dynamic strategies, tokens (KTransformers' update "
                        "follows such batches; adaptive serves prompts the same way, so the two differ by their "
                        "placement only); 0 = off (default 512, KTransformers' tutorial value)")
    p.add_argument("--prefill-chunk", type=positive_int, default=512, help="prompt tokens per step (default 512)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs per measured configuration on this machine, best taken (default 3)")
    p.add_argument("--tolerance", type=positive_float, default=0.15,
                   help="this-cpu validation tolerance (default 0.15)")
    p.add_argument("--timed-strategies", type=strategy_list, default=None,
                   help="with --gpu-profile this-cpu: also serve these strategies end to end on this CPU, --repeats "
                        "alternating rounds, and report each cell's median and spread (e.g. "
                        "uniform,frequency,time-balanced,adaptive)")
    p.add_argument("--timed-ratios", type=ratio_list, default=None,
                   help="ratios of the timed cells (default: the --ratios strictly between 0 and 1)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the prompt sample and split (default 0)")
    p.add_argument("--out", type=output_file, help="write every figure as JSON")
    p.add_argument("--markdown", type=output_file, help="also write the tables as markdown to this file")
    p.add_argument("--plot", type=plot_file, help="write tokens/s and hit rate against ratio per strategy to this PNG")
    add_cpu_flags(p)  # the CPU tier whose time is measured
    add_adaptive_flags(p, STRATEGY)


def run(args) -> int:
    if args.bench == "placement":
        return run_placement(args)
    return run_dynamic(args)


def layer_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of layer indices") from None
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct layer indices >= 0, got '{text}'")
    return values


def run_placement(args) -> int:
    if (args.dataset is None) == (args.routing_trace is None):
        raise TiermoeError("give --dataset (prompts the model routes itself) or --routing-trace (routing from a "
                           "trace), one of the two")
    if args.routing_trace is None and (args.routing_calibration or args.routing_layers):
        raise TiermoeError("--routing-calibration and --routing-layers go with --routing-trace")
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
