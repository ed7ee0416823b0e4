"""tiermoe fit's flags: will a model fit this GPU and this host, before anything is loaded (headers or a config
file only; run: fit_run)."""

from __future__ import annotations

from tiermoe.cli.choices import DEFAULT_EXPERT_CHUNK
from tiermoe.cli.flags import (
    add_command,
    expert_chunk,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from tiermoe.config import CPU_EXPERT_DTYPES, NON_EXPERT_DTYPES


def add_parser(sub) -> None:
    p = add_command(
        sub, "fit",
        "Say whether a model fits before loading it: GPU memory (non-expert weights, GPU experts, KV cache at the "
        "token budget, layerwise-prefill buffer), host memory (CPU-tier experts in their format) and the largest "
        "GPU expert count that fits. Reads safetensors or GGUF headers only, or a config file alone (any name; the "
        "weights' dtype is the one it states unless --dtype says otherwise). Without --model, the bundled demo model.",
        "tiermoe fit --model /models/Qwen3-30B-A3B --gpu-memory-gb 24 --ram-gb 64",
        "tiermoe fit --model /models/DeepSeek-V3 --gpu-memory-gb 80 --cpu-expert-dtype int4 --max-total-tokens 32768",
        "tiermoe fit --model config.json --dtype fp8 --gpu-memory-gb 24 --ram-gb 512",
        "tiermoe fit --model deepseek-v3-config.json --gpu-memory-gb 80 --ram-gb 512",
        "tiermoe fit --model /models/Qwen3-30B-A3B-Q4_K_M.gguf --gpu-memory-gb 16",
        "tiermoe fit --model /models/Qwen3-30B-A3B --ram-gb 32 --cpu-expert-dtype int4 --non-expert-dtype int4",
        "tiermoe fit --model /models/Qwen3-30B-A3B --train --ram-gb 24          # longest LoRA training context, and "
        "the finetune command for it",
    )
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="checkpoint directory, GGUF file or directory, or a config file (.json, any name) "
                        "(default: the bundled demo model)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32", "fp8"),
                   help="what the weights are when only a config file is given (fp8: the released FP8 layout; "
                        "default: the dtype the config states); with weights: the compute dtype (default: the "
                        "checkpoint's)")
    p.add_argument("--gpu-memory-gb", type=non_negative_float, help="GPU memory tiermoe may use, GiB")
    p.add_argument("--ram-gb", type=non_negative_float, help="host memory tiermoe may use, GiB")
    p.add_argument("--max-total-tokens", type=positive_int, default=8192, help="KV cache token budget (default 8192)")
    p.add_argument("--max-running-requests", type=positive_int, default=16,
                   help="sequences at once (default 16, as serve's): each keeps its sliding windows and "
                        "linear-attention state, and a forward thread with its cuBLAS workspace")
    p.add_argument("--gpu-prefill-buffer-gb", type=non_negative_float, default=0.0,
                   help="layerwise-prefill buffer (with --kt-gpu-prefill-token-threshold; default 0)")
    p.add_argument("--cpu-expert-dtype", choices=CPU_EXPERT_DTYPES,
                   help="format of CPU-tier experts (default: the compute dtype; int4 keeps the down projections in "
                        "int6, as a load does)")
    p.add_argument("--non-expert-dtype", choices=NON_EXPERT_DTYPES,
                   help="count the non-expert linears packed in this format, as a CPU-only load with "
                        "--non-expert-dtype holds them (int4: attention's k / v in int8, its output in int6; "
                        "default: the compute dtype)")
    p.add_argument("--head-dtype", choices=NON_EXPERT_DTYPES,
                   help="with --non-expert-dtype: the LM head's format, as --head-dtype loads it (default: theirs, "
                        "int6 under int4)")
    p.add_argument("--gpu-experts", type=non_negative_int,
                   help="GPU-tier experts in total to check (default: the largest count that fits)")
    p.add_argument("--train", action="store_true",
                   help="predict the longest context one LoRA training step fits in host memory (--ram-gb, default: "
                        "this machine's available memory), every expert on the CPU tier, gradient checkpointing on; "
                        "the per-token bytes are measured on copies of the model's first layers with random weights "
                        "(seconds to minutes, and their size on disk in a temporary directory); the last line is the "
                        "tiermoe finetune command that trains at that length (--gradient-checkpointing, "
                        "--expert-chunk, --max-length, --batch-size 1), e.g. "
                        "tiermoe fit --model /models/Qwen3-30B-A3B --train --ram-gb 24")
    p.add_argument("--lora-rank", type=positive_int, default=None,
                   help="with --train: LoRA rank on all linears and every expert, alpha 2 x rank, as tiermoe "
                        "finetune trains (default 16), e.g. --train --lora-rank 8")
    p.add_argument("--expert-chunk", type=expert_chunk, default=None,
                   help=f"with --train: tokens the CPU tier computes at a time in training (default "
                        f"{DEFAULT_EXPERT_CHUNK}; 0: the whole context; tiermoe.training.set_expert_chunk), e.g. "
                        "--train --expert-chunk 2048")
