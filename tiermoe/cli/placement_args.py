"""What the placement flags mean for a model: the plan a single-process command loads with, and the fit check
before a weight is read. Run-side (imports the planner and the fit check, so torch): the flags themselves are
tiermoe.cli.placement_flags, which parsers import.
"""

from __future__ import annotations

from tiermoe.arch import detect, load_config
from tiermoe.cli.cpu_flags import cpu_from_args
from tiermoe.cli.placement_flags import max_running_from_args, placement_config_from_args, prefill_buffer_from_args
from tiermoe.fit import check_before_loading
from tiermoe.model.plan_source import resolve_plan
from tiermoe.bundled import resolve_model
from tiermoe.placement.plan import PlacementPlan


def placement_from_args(args):
    """What the flags ask for, before it meets a model: a PlacementPlan (from --plan), a PlacementConfig (from
    the flags), or None (no GPU experts asked for). `plan_from_args` turns it into the plan."""
    if args.plan:
        return PlacementPlan.load(args.plan)
    config = placement_config_from_args(args)
    return config if config.sized or config.strategy != "uniform" else None


def plan_from_args(args, device: str) -> PlacementPlan:
    """The one PlacementPlan of a single-process command (generate, serve, record): the flags' placement planned
    against --model once; the fit check and the loader both take it."""
    model_dir = resolve_model(args.model)
    return resolve_plan(placement_from_args(args), model_dir, detect(load_config(model_dir)), 1, device)


def check_fit_from_args(args, plan: PlacementPlan, device) -> None:
    """Stop with a clear message, before a weight is read, when the plan will not fit
    (tiermoe.fit.check_before_loading: headers only)."""
    check_before_loading(args.model, plan, device, args.max_total_tokens, prefill_buffer_from_args(args),
                         cpu_from_args(args).expert_dtype, max_running_from_args(args))
