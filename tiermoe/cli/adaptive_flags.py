"""The adaptive placement policy's settings as flags (--adaptive-*), shared by the commands that run it: generate
and serve (with --placement-policy adaptive), `bench dynamic` (which always replays it) and `bench placement` (its
`adaptive` strategy).

Every flag defaults to None, so a command knows which ones were given: a setting left out keeps
tiermoe.config.AdaptiveSettings' default (the one measured on real routing, BENCHMARKS.md, "Placement on real routing").
"""

from __future__ import annotations

import argparse

from tiermoe.cli.flags import fraction, non_negative_float, non_negative_int, positive_float, positive_int
from tiermoe.config import AdaptiveSettings
from tiermoe.errors import TiermoeError

# flag -> AdaptiveSettings field (its argparse dest: adaptive_<field>)
FLAGS = {
    "--adaptive-cross-layer": "cross_layer",
    "--adaptive-prompt-evidence": "prompt_evidence",
    "--adaptive-prompt-weight": "prompt_weight",
    "--adaptive-swap-z": "swap_z_score",
    "--adaptive-settled-swap-z": "settled_swap_z_score",
    "--adaptive-z": "z_score",
    "--adaptive-half-life": "half_life_tokens",
    "--adaptive-recent-half-life": "recent_half_life_tokens",
    "--adaptive-horizon": "horizon_tokens",
    "--adaptive-margin": "margin",
    "--adaptive-max-swaps": "max_swaps_in_flight",
    "--adaptive-replan-every": "replan_every",
}
DEST = "adaptive_"  # argparse dests: adaptive_<field>, apart from other commands' flags
# where the flags are: (what they go with, in the group's title; whether --adaptive-max-swaps may be 0)
POLICY, REPLAY, STRATEGY = "policy", "replay", "strategy"
_MODES = {POLICY: ("; with --placement-policy adaptive", False), REPLAY: ("", True),
          STRATEGY: ("; for the adaptive strategy", True)}


def add_adaptive_flags(p: argparse.ArgumentParser, mode: str = POLICY) -> None:
    """mode: POLICY for generate / serve, which take at least 1 swap in flight (0 would be static placement);
    REPLAY for `bench dynamic`, where --adaptive-max-swaps defaults to --copy-budget and may be 0 (no copies, as
    the caches allow); STRATEGY for `bench placement`'s adaptive strategy (0 allowed: its starting placement)."""
    d = AdaptiveSettings()
    title, zero_swaps = _MODES[mode]
    g = p.add_argument_group("adaptive placement settings (tiermoe/placement/adaptive_policy.py)" + title)
    on_off = argparse.BooleanOptionalAction
    g.add_argument("--adaptive-cross-layer", dest=DEST + "cross_layer", action=on_off, default=None,
                   help="a swap may move a GPU slot from a cold layer to a hot expert of another layer, the total "
                        "GPU experts unchanged (default: on with one GPU; with several GPUs only when given, since "
                        "it changes each GPU's per-layer share that the split across GPUs placed)")
    g.add_argument("--adaptive-prompt-evidence", dest=DEST + "prompt_evidence", action=on_off, default=None,
                   help="a prompt's routing forecasts its request's decode, with a weight learned by scoring each "
                        "prompt against its decode (default off: it gained nothing on the traces measured)")
    g.add_argument("--adaptive-prompt-weight", dest=DEST + "prompt_weight", type=fraction, metavar="W",
                   help="that weight fixed, 0-1, instead of learned (turns prompt evidence on)")
    g.add_argument("--adaptive-swap-z", dest=DEST + "swap_z_score", type=non_negative_float, metavar="Z",
                   help="cautious valuation: a lasting swap counts the served rates Z standard errors against it, "
                        f"so near-ties are not swapped on noise (default {d.swap_z_score:g}; 0 = off)")
    g.add_argument("--adaptive-settled-swap-z", dest=DEST + "settled_swap_z_score", type=non_negative_float,
                   metavar="Z", help="the same once a longer check has enough evidence to tell a lasting departure "
                                     "from the calibration from a request's own popularity (default "
                                     f"{d.settled_swap_z_score:g})")
    g.add_argument("--adaptive-z", dest=DEST + "z_score", type=non_negative_float, metavar="Z",
                   help="follow the served workload (and learn the short-window and prompt weights) only this many "
                        f"standard errors past noise (default {d.z_score:g})")
    g.add_argument("--adaptive-half-life", dest=DEST + "half_life_tokens", type=positive_float, metavar="TOKENS",
                   help=f"memory of the served workload's estimate (default {d.half_life_tokens:g} tokens)")
    g.add_argument("--adaptive-recent-half-life", dest=DEST + "recent_half_life_tokens", type=positive_float,
                   metavar="TOKENS", help="the short window of temporal locality (default "
                   f"{d.recent_half_life_tokens:g} tokens)")
    g.add_argument("--adaptive-horizon", dest=DEST + "horizon_tokens", type=positive_float, metavar="TOKENS",
                   help="how long a lasting swap is expected to pay (default: twice the served tokens seen, "
                        "at most half the half-life)")
    g.add_argument("--adaptive-margin", dest=DEST + "margin", type=non_negative_float, metavar="M",
                   help=f"swap only when the expected saving exceeds M x its copies (default {d.margin:g})")
    g.add_argument("--adaptive-max-swaps", dest=DEST + "max_swaps_in_flight", metavar="N",
                   type=non_negative_int if zero_swaps else positive_int,
                   help="swaps in flight at once, its copy budget (default "
                        f"{'--copy-budget' if mode == REPLAY else d.max_swaps_in_flight}"
                        f"{'; 0 = never swaps' if zero_swaps else ''})")
    g.add_argument("--adaptive-replan-every", dest=DEST + "replan_every", type=positive_int, metavar="N",
                   help=f"steps between re-plans (default {d.replan_every})")


def given_adaptive_flags(args) -> list[str]:
    return [flag for flag, name in FLAGS.items() if getattr(args, DEST + name, None) is not None]


def adaptive_from_args(args, max_swaps: int | None = None) -> AdaptiveSettings:
    """The AdaptiveSettings the flags ask for; `max_swaps` stands in for --adaptive-max-swaps when it is not given
    (bench dynamic: the caches' --copy-budget)."""
    values = {name: getattr(args, DEST + name, None) for name in FLAGS.values()}
    if values["prompt_weight"] is not None:
        if values["prompt_evidence"] is False:
            raise TiermoeError("--adaptive-prompt-weight sets the weight of prompt evidence; it cannot go with "
                               "--no-adaptive-prompt-evidence")
        values["prompt_evidence"] = True
    if values["max_swaps_in_flight"] is None and max_swaps is not None:
        values["max_swaps_in_flight"] = max_swaps
    return AdaptiveSettings(**{k: v for k, v in values.items() if v is not None})
