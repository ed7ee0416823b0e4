"""tiermoe stats's run: the statistics files summed, their per-layer skew, and every strategy's expected hit
rate; optionally checked against a plan and drawn."""

from __future__ import annotations

import json
import warnings

from tiermoe.analysis.strategy_sweep import strategy_hit_rate_report
from tiermoe.cli.plots import plot_report
from tiermoe.errors import TiermoeError
from tiermoe.placement.plan import PlacementPlan
from tiermoe.routing.summary import format_report, report
from tiermoe.stats.io import load_stats


def run(args) -> int:
    stats = load_stats(args.files)
    eval_stats = load_stats(args.eval, stats.num_layers, stats.num_experts) if args.eval else None
    plan_mask = None
    if args.plan:
        plan = PlacementPlan.load(args.plan)
        if (plan.num_layers, plan.num_experts) != (stats.num_layers, stats.num_experts):
            raise TiermoeError(f"plan '{args.plan}' is [{plan.num_layers}, {plan.num_experts}]; the statistics are "
                               f"[{stats.num_layers}, {stats.num_experts}]")
        if stats.gpu_masks_PLE is None:
            raise TiermoeError(f"--plan checks GPU-tier snapshots, but {', '.join(stats.sources)} has none "
                               "(record with --record-kt-gpu-expert-distribution)")
        plan_mask = plan.mask
    result = report(stats, plan_mask, _hit_rates(stats, eval_stats, args.placement_seed))
    print(json.dumps(result) if args.json else format_report(result))
    if args.plot:
        plot_report(result, args.plot)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def _hit_rates(stats, eval_stats, seed: int) -> dict | None:
    """The strategies' expected hit rates, or None (with a warning) when the statistics hold no routed token to
    place by or to measure on: a hit rate of nothing is no figure, and 0/0 would print as nan%."""
    for which, s in (("", stats), ("--eval ", eval_stats)):
        if s is not None and not bool(s.counts_LE.any()):
            warnings.warn(f"the counts of {which}{', '.join(s.sources)} are all zero (no routed tokens): no hit "
                          "rates to show", stacklevel=2)
            return None
    return strategy_hit_rate_report(stats, eval_stats, seed)
