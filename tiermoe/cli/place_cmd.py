"""tiermoe place: decide which experts go to the GPU tier, show it, write plan.json."""

from __future__ import annotations

import json

from tiermoe.cli.flags import (
    add_command,
    non_negative_int,
    output_file,
    plot_file,
    positive_int,
)
from tiermoe.cli.placement_flags import add_placement_flags, placement_config_from_args
from tiermoe.cli.plots import plot_plan
from tiermoe.errors import TiermoeError
from tiermoe.fit import available_ram
from tiermoe.model.plan_source import placement_target
from tiermoe.models import resolve_model
from tiermoe.placement.metrics import hit_rate
from tiermoe.placement.plan import PlacementPlan
from tiermoe.placement.planner import PlacementTarget, make_plan
from tiermoe.placement.report import format_plan, plan_rows
from tiermoe.stats.io import load_counts


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


def parse_layers(text: str, num_layers: int) -> tuple[int, ...]:
    spans = []  # (lo, hi) inclusive
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = part.split("-")
                spans.append((int(lo), int(hi)))
            elif part:
                spans.append((int(part), int(part)))
    except ValueError:
        raise TiermoeError(f"--moe-layers '{text}' is not a list of layers like '3-60' or '1,2,5'") from None
    for lo, hi in spans:  # before range(): '0-100000000000' would build a set of 10**11 layers
        if not 0 <= lo <= hi < num_layers:
            what = f"{lo}-{hi}" if lo != hi else str(lo)
            raise TiermoeError(f"--moe-layers {what} is not a range within 0..{num_layers - 1}")
    return tuple(sorted({layer for lo, hi in spans for layer in range(lo, hi + 1)}))


def _target(args):
    if args.num_layers is None and args.num_experts is None:
        return placement_target(resolve_model(args.model))
    if args.model:
        raise TiermoeError("give either --model or --num-layers/--num-experts, not both")
    if args.num_layers is None or args.num_experts is None:
        raise TiermoeError("a model-free plan needs both --num-layers and --num-experts")
    if args.moe_layers:
        moe = parse_layers(args.moe_layers, args.num_layers)
    else:
        moe = tuple(range(args.first_k_dense or 0, args.num_layers))
    return PlacementTarget(args.num_layers, args.num_experts, moe)


def check_memory(target: PlacementTarget) -> None:
    """Planning holds a few [layers, experts] tensors: refuse a shape this machine's free memory cannot hold."""
    free = available_ram()
    if free is not None and target.planning_bytes > free:
        raise TiermoeError(f"planning {target.num_layers} layers x {target.num_experts} experts needs about "
                           f"{target.planning_bytes / 2**20:,.0f} MiB; {free / 2**20:,.0f} MiB are available")


def run(args) -> int:
    target = _target(args)
    check_memory(target)
    counts = None
    if args.init_expert_location:
        counts = load_counts(args.init_expert_location, target.num_layers, target.num_experts)
    if args.plan:
        plan = PlacementPlan.load(args.plan)
    else:
        plan = make_plan(placement_config_from_args(args), target, counts, args.gpu_device)
    if counts is not None and not bool(counts.any()):
        counts = None  # no routed tokens: no hit rate to show (the planner said so)
    if args.json:
        out = {"rows": plan_rows(plan, target.moe_layers, counts, target.bytes_per_expert), "plan": plan.to_dict()}
        if counts is not None:
            out["expected_hit_rate"] = hit_rate(plan.mask, counts)
        print(json.dumps(out))
    else:
        print(format_plan(plan, target.moe_layers, counts, target.bytes_per_expert))
        if "memory" in plan.budget:
            print(f"memory: {plan.budget['memory']}")
    if args.out:
        plan.save(args.out)
        if not args.json:
            print(f"wrote {args.out}")
    if args.plot:
        plot_plan(plan, args.plot, counts)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0
