"""tiermoe place's flags: decide which experts go to the GPU tier, show it, write plan.json (run: place_run)."""

from __future__ import annotations

from tiermoe.cli.flags import (
    add_command,
    non_negative_int,
    output_file,
    plot_file,
    positive_int,
)
from tiermoe.cli.placement_flags import add_placement_flags


def add_parser(sub) -> None:
    p = add_command(
        sub, "place",
        "Choose the GPU-tier experts with a placement strategy and a budget, print a per-layer table and the "
        "expected hit rate, and write the plan (the one plan.json format every command reads). Works from a "
        "checkpoint (--model) or from a model shape alone (--num-layers/--num-experts/--moe-layers).",
        "tiermoe place --model /models/Qwen3-30B-A3B --num-gpu-experts 16 --out plan.json",
        "tiermoe place --strategy frequency --init-expert-location stats.pt --gpu-experts-ratio 0.25 --out plan.json "
        "--plot plan.png",
        "tiermoe place --model /models/DeepSeek-V3 --gpu-memory-gb 80 --strategy balanced "
        "--init-expert-location stats.pt --num-gpus 4 --gpu-split balanced --out plan.json",
        "tiermoe place --num-layers 6 --num-experts 4 --moe-layers 2-5 --num-gpu-experts 2 --strategy front-loading",
    )
    p.add_argument("--model", "--model-path", dest="model", help="checkpoint directory (default: the bundled model)")
    p.add_argument("--num-layers", type=positive_int, help="model-free plan: number of layers")
    p.add_argument("--num-experts", type=positive_int, help="model-free plan: experts per MoE layer")
    p.add_argument("--moe-layers", help="model-free plan: MoE layers, e.g. '3-60' or '1,2,5' (default: all)")
    p.add_argument("--first-k-dense", type=non_negative_int, help="model-free plan: the first K layers are dense")
    add_placement_flags(p, seed_flags=("--seed", "--placement-seed"))
    p.add_argument("--gpu-device", default=None, help="CUDA device for --gpu-memory-gb auto (default cuda:0)")
    p.add_argument("--out", type=output_file, help="write the plan here (plan.json)")
    p.add_argument("--plot", type=plot_file, help="draw a heatmap (layers x experts, GPU experts marked) to this PNG")
    p.add_argument("--json", action="store_true", help="print JSON (rows, hit rate, plan) instead of a table")
