"""tiermoe place's run: plan the GPU tier for a checkpoint or a model shape, print the per-layer table and the
expected hit rate, write the plan and its plot."""

from __future__ import annotations

import json

from tiermoe.bundled import resolve_model
from tiermoe.cli.placement_flags import placement_config_from_args
from tiermoe.cli.plots import plot_plan
from tiermoe.errors import TiermoeError
from tiermoe.model.plan_source import placement_target
from tiermoe.placement.free_memory import available_ram
from tiermoe.placement.metrics import hit_rate
from tiermoe.placement.plan import PlacementPlan
from tiermoe.placement.planner import PlacementTarget, make_plan
from tiermoe.placement.report import format_plan, plan_rows
from tiermoe.stats.io import load_counts


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
