"""tiermoe bench: placement benchmarks (`dynamic`: policies replayed on a trace)."""

from __future__ import annotations

import json

from tiermoe.cli.flags import add_command, positive_int


def ratio_list(text: str) -> list[float]:
    import argparse

    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of ratios") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"ratios must be between 0.0 and 1.0, got '{text}'")
    return values


def add_parser(sub) -> None:
    p = add_command(sub, "bench", "Placement benchmarks: `tiermoe bench dynamic` replays a per_token trace.",
                    "tiermoe bench dynamic --trace sharegpt.pt --calibration gsm8k.pt --plot dynamic.png")
    benches = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    d = add_command(
        benches, "dynamic",
        "Replay a per_token trace (tiermoe record --mode per_token) through every placement policy at each GPU "
        "ratio: hit rate (measured on the trace), estimated time and tokens/s (cost model; copies charged in "
        "full), copy traffic. Static strategies take their statistics from --calibration.",
        "tiermoe bench dynamic --trace held_out.pt --calibration calib.pt",
        "tiermoe bench dynamic --trace t.pt --calibration c.pt --ratios 0.1,0.25,0.5 --gpu-profile h200 --json",
    )
    d.prog = "tiermoe bench dynamic"
    d.add_argument("--trace", required=True, help="per_token trace to replay (.pt)")
    d.add_argument("--calibration", help="statistics or trace for frequency/balanced/adaptive (another split)")
    d.add_argument("--model", help="checkpoint whose expert sizes the cost model uses (default: the bundled model)")
    d.add_argument("--ratios", type=ratio_list, default=None, help="GPU expert ratios (default 0.1,...,0.9)")
    d.add_argument("--prefill-threshold", type=positive_int, default=None,
                   help="layerwise GPU prefill threshold for the dynamic policies (default: none)")
    d.add_argument("--gpu-profile", default="rtx4090", help="rtx4090 (default), h200, or a JSON file")
    d.add_argument("--cpu-bandwidth-gbs", type=float, default=25.0, help="CPU read bandwidth, GB/s (default 25)")
    d.add_argument("--cpu-gflops", type=float, default=400.0, help="CPU expert GFLOP/s at prefill (default 400)")
    d.add_argument("--json", action="store_true", help="print JSON with every figure")
    d.add_argument("--plot", help="write hit rate and estimated tokens/s against ratio to this PNG")


def run(args) -> int:
    import torch

    from tiermoe.arch import detect, load_config
    from tiermoe.benchmarking.dynamic import DEFAULT_RATIOS, format_table, plot_bench, run_dynamic_bench
    from tiermoe.errors import TiermoeError
    from tiermoe.models import resolve_model
    from tiermoe.placement.cost import BandwidthCostModel
    from tiermoe.placement.profiles import load_profile
    from tiermoe.stats.io import load_counts
    from tiermoe.stats.replay import trace_passes

    def load_trace(path):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError) as err:
            raise TiermoeError(f"cannot load trace '{path}': {str(err).splitlines()[0][:200]}") from None

    passes = trace_passes(load_trace(args.trace))
    spec = detect(load_config(resolve_model(args.model)))
    if (spec.num_layers, spec.num_experts) != (passes.num_layers, passes.num_experts):
        raise TiermoeError(f"the trace is of a {passes.num_layers} x {passes.num_experts} model, --model is "
                           f"{spec.num_layers} x {spec.num_experts}")
    calibration = load_counts(args.calibration, passes.num_layers, passes.num_experts) if args.calibration else None
    gpu = load_profile(args.gpu_profile)
    cost = BandwidthCostModel(bytes_per_expert=spec.bytes_per_expert(torch.bfloat16),
                              cpu_read_bandwidth=args.cpu_bandwidth_gbs * 1e9, gpu_read_bandwidth=gpu.memory_bandwidth,
                              copy_bandwidth=gpu.pcie_bandwidth, flops_per_pair=6 * spec.hidden_size *
                              spec.expert_intermediate_size, cpu_flops=args.cpu_gflops * 1e9, gpu_flops=gpu.compute_flops)
    bench = run_dynamic_bench(passes, cost, args.ratios or DEFAULT_RATIOS, calibration, args.prefill_threshold)
    if args.json:
        print(json.dumps({"gpu_profile": gpu.as_dict(), "passes": passes.num_passes, "rows": bench.rows}))
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
