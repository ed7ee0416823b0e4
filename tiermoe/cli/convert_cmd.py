"""tiermoe convert: write the CPU-tier experts in their format once; later loads map them instead."""

from __future__ import annotations

from tiermoe.cli.flags import add_command, dtype_flag
from tiermoe.convert import convert_cpu_experts


def add_parser(sub) -> None:
    p = add_command(
        sub, "convert",
        "Convert every routed expert of a checkpoint (safetensors, FP8 or GGUF) to a CPU-tier format once, as "
        "`kt quant` does, streaming one expert at a time. The output directory is then the --model to load: its "
        "CPU-tier experts are memory-mapped, non-expert weights and GPU-tier experts come from the source.",
        "tiermoe convert --model /models/DeepSeek-V3 --cpu-expert-dtype int4 --out /models/DeepSeek-V3-int4",
        "tiermoe convert --model /models/Qwen3-30B-A3B-Q4_K_M.gguf --cpu-expert-dtype int8 --out /models/q30b-int8",
        "tiermoe generate --model /models/DeepSeek-V3-int4 --gpu-device cuda:0 --prompt Hi",
    )
    p.add_argument("--model", required=True, help="source checkpoint directory or GGUF file / directory")
    p.add_argument("--cpu-expert-dtype", required=True, choices=("bf16", "int8", "int4"),
                   help="the CPU tier's format (int4: 0.55 bytes/param, int8: 1, bf16: 2)")
    p.add_argument("--out", required=True, help="new (or empty) directory for the converted experts")
    p.add_argument("--dtype", type=dtype_flag, default=None,
                   help="dtype experts are dequantised to before conversion: bf16, fp16, fp32 (default: the model's)")


def run(args) -> int:
    out = convert_cpu_experts(args.model, args.cpu_expert_dtype, args.out, args.dtype)
    print(f"converted CPU-tier experts written to {out}; load them with --model {out}")
    return 0
