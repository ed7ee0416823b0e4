"""Placement flags shared by every command that places experts (place, generate, serve, ...), and the settings
they describe (PlacementConfig, DynamicPlacementConfig).

Primary names are plain; SGLang-kt's `--kt-...` spellings are accepted as aliases so a KTransformers launch
line works unchanged. Light (no torch): parsers import it for `--help`. Turning the flags into a plan for a model
is tiermoe.cli.placement_args, which the run modules import.
"""

from __future__ import annotations

import argparse
import math
import warnings

from tiermoe.cli.adaptive_flags import (
    adaptive_from_args,
    add_adaptive_flags,
    given_adaptive_flags,
)
from tiermoe.cli.flags import non_negative_int, positive_float, positive_int, seed_int
from tiermoe.config import (
    GPU_SPLIT_METHODS,
    PLACEMENT_STRATEGIES,
    DynamicPlacementConfig,
    PlacementConfig,
)
from tiermoe.errors import TiermoeError


def ratio(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a number") from None
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a ratio between 0.0 and 1.0, got {value}")
    return number


def memory_gb(value: str):
    if value == "auto":
        return value
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is neither a number of GB nor 'auto'") from None
    if not math.isfinite(number) or number < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of GB >= 0 or 'auto', got {value}")
    return number


def add_placement_flags(p: argparse.ArgumentParser, seed_flags=("--placement-seed",)) -> None:
    g = p.add_argument_group("placement (which experts live on the GPU tier)")
    g.add_argument("--placement-strategy", "--strategy", "--kt-expert-placement-strategy", dest="strategy",
                   choices=PLACEMENT_STRATEGIES, default="uniform",
                   help="uniform (default), front-loading, random, frequency (needs statistics), balanced "
                        "(needs statistics: frequency that keeps every MoE layer covered)")
    g.add_argument("--num-gpu-experts", "--kt-num-gpu-experts", dest="num_gpu_experts", type=non_negative_int,
                   help="GPU experts PER MoE LAYER (total = N x MoE layers, over all GPUs together, not per rank; "
                        "as SGLang-kt's code and tutorial use it, although one KTransformers page calls it a total)")
    g.add_argument("--gpu-experts-ratio", "--kt-gpu-experts-ratio", dest="gpu_experts_ratio", type=ratio,
                   help="share of all routed experts on the GPU tier, 0.0-1.0: floor(R x MoE layers x experts); "
                        "wins over --num-gpu-experts (with a warning)")
    g.add_argument("--gpu-memory-gb", dest="gpu_memory_gb", type=memory_gb,
                   help="GPU memory (per GPU) tiermoe may use; the expert count follows from the model's real bytes "
                        "after non-expert weights and the KV cache. 'auto' on CUDA: free memory less a margin")
    g.add_argument("--max-total-tokens", dest="max_total_tokens", type=positive_int, default=8192,
                   help="KV cache tokens reserved by --gpu-memory-gb (default 8192)")
    g.add_argument("--init-expert-location", "--kt-init-expert-location", dest="init_expert_location",
                   help="activation statistics .pt (SGLang logical_count [buf, L, E], [L, E], or tiermoe record "
                        "output)")
    g.add_argument(*seed_flags, dest="placement_seed", type=seed_int, default=42,
                   help="seed of the random strategy (default 42, as SGLang-kt)")
    g.add_argument("--num-gpus", dest="num_gpus", type=positive_int, default=1, help="GPUs to split the plan over")
    g.add_argument("--gpu-split", dest="gpu_split", choices=GPU_SPLIT_METHODS, default="balanced",
                   help="how to split over GPUs: balanced (memory and load), layers (contiguous), round-robin")
    g.add_argument("--plan", dest="plan", help="a plan.json written by `tiermoe place` (instead of the flags above)")


def add_dynamic_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dynamic placement (experts that move while serving)")
    g.add_argument("--kt-gpu-prefill-token-threshold", "--gpu-prefill-token-threshold", dest="prefill_threshold",
                   type=positive_int, help="prefill batches of at least this many tokens run all their experts on "
                   "the GPU, CPU-tier experts streamed through two buffers (this flag alone turns it on)")
    g.add_argument("--gpu-prefill-buffer-gb", dest="prefill_buffer_gb", type=positive_float, default=1.0,
                   help="GPU memory for those two streaming buffers (default 1 GB; counted by --gpu-memory-gb)")
    g.add_argument("--kt-enable-dynamic-expert-update", dest="kt_dynamic", action="store_true",
                   help="after such a batch, keep its most-used experts of each layer on the GPU (SGLang-kt)")
    g.add_argument("--placement-policy", dest="placement_policy", choices=("static", "kt-dynamic", "adaptive"),
                   default=None, help="static (default), kt-dynamic (= --kt-enable-dynamic-expert-update), or "
                   "adaptive: follow the decayed expert load over prefill and decode, swapping experts "
                   "asynchronously when the expected saving beats the copy cost (settings: --adaptive-* below)")
    add_adaptive_flags(p)


def dynamic_from_args(args):
    """A DynamicPlacementConfig from the flags, or None when nothing dynamic was asked for."""
    policy = args.placement_policy or ("kt-dynamic" if args.kt_dynamic else "static")
    if args.kt_dynamic and policy == "adaptive":
        warnings.warn("--placement-policy adaptive replaces --kt-enable-dynamic-expert-update", stacklevel=2)
    given = given_adaptive_flags(args)
    if given and policy != "adaptive":
        raise TiermoeError(f"{', '.join(given)} set the adaptive policy's settings; they need "
                           f"--placement-policy adaptive (the policy is {policy})")
    config = DynamicPlacementConfig(policy=policy, prefill_threshold=args.prefill_threshold,
                                    prefill_buffer_gb=args.prefill_buffer_gb, adaptive=adaptive_from_args(args))
    return config if config.active or args.kt_dynamic else None


def placement_config_from_args(args) -> PlacementConfig:
    """The PlacementConfig the placement flags describe (whether or not they size a GPU tier)."""
    return PlacementConfig(
        strategy=args.strategy, num_gpu_experts=args.num_gpu_experts, gpu_experts_ratio=args.gpu_experts_ratio,
        gpu_memory_gb=args.gpu_memory_gb, init_expert_location=args.init_expert_location, seed=args.placement_seed,
        num_gpus=args.num_gpus, gpu_split=args.gpu_split, kv_cache_tokens=args.max_total_tokens,
        prefill_buffer_gb=prefill_buffer_from_args(args), max_running=max_running_from_args(args),
    )


def max_running_from_args(args) -> int:
    """Sequences the command runs at once (serve's --max-running-requests, record's --batch-size; else LLM's 16)."""
    return getattr(args, "max_running_requests", None) or getattr(args, "batch_size", None) or 16


def prefill_buffer_from_args(args) -> float:
    """GiB the layerwise-prefill buffers take on the GPU: --gpu-prefill-buffer-gb once the threshold turns it on."""
    return args.prefill_buffer_gb if getattr(args, "prefill_threshold", None) else 0.0
