"""tiermoe bench's flags: placement benchmarks (`dynamic`: policies replayed on a trace; `placement`: the
strategies x GPU-expert-ratio table, measured on CUDA and estimated elsewhere). The runs are bench_run."""

from __future__ import annotations

import argparse

from tiermoe.cli.adaptive_flags import REPLAY, STRATEGY, add_adaptive_flags
from tiermoe.cli.choices import BENCH_STRATEGIES, DEFAULT_COPY_BUDGET
from tiermoe.cli.cpu_flags import add_cpu_flags
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
        "tiermoe make-model --arch deepseek_v2 --preset deepseek-v2-lite --layers 5 --out dsv2l-5 && "
        "tiermoe bench placement --model dsv2l-5 --routing-trace esft_law.csv --gpu-profile this-cpu",
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


def layer_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of layer indices") from None
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct layer indices >= 0, got '{text}'")
    return values
