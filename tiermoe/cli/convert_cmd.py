"""tiermoe convert's flags and help (light: `tiermoe convert --help` loads neither torch nor transformers); running
it is tiermoe.cli.convert_run, imported only then. Converting writes the CPU-tier experts in their format once;
later loads map them instead."""

from __future__ import annotations

from tiermoe.cli.flags import add_command, dtype_flag
from tiermoe.config import CPU_EXPERT_DTYPES


def add_parser(sub) -> None:
    p = add_command(
        sub, "convert",
        "Convert every routed expert of a checkpoint (safetensors, FP8 or GGUF) to a CPU-tier format once, as "
        "`kt quant` does, streaming one expert at a time. The output directory is then the --model to load: its "
        "CPU-tier experts are memory-mapped, non-expert weights and GPU-tier experts come from its source/ folder, "
        "the source's weight files hard-linked there (no disk used) when --out is on the source's filesystem, "
        "else copied; so it loads on its own, wherever it is moved and whether or not the source is kept. Its "
        "README.md says what the conversion was (the source's own card is source/README.md).",
        "tiermoe convert --model /models/DeepSeek-V3 --cpu-expert-dtype int4 --out /models/DeepSeek-V3-int4",
        "tiermoe convert --model /models/Qwen3-30B-A3B-Q4_K_M.gguf --cpu-expert-dtype int8 --out /models/q30b-int8",
        "tiermoe generate --model /models/DeepSeek-V3-int4 --gpu-device cuda:0 --prompt Hi",
    )
    p.add_argument("--model", required=True, help="source checkpoint directory or GGUF file / directory")
    p.add_argument("--cpu-expert-dtype", required=True, choices=CPU_EXPERT_DTYPES,
                   help="the CPU tier's format (int4: 0.55 bytes/param, int6: 0.81, int8: 1, bf16: 2); int4 keeps "
                        "the down projections in int6 unless --cpu-expert-down-dtype says otherwise")
    p.add_argument("--cpu-expert-down-dtype", choices=CPU_EXPERT_DTYPES, default=None,
                   help="the experts' down projections' format (default: --cpu-expert-dtype's, int6 under int4)")
    p.add_argument("--out", required=True,
                   help="new (or empty) directory for the converted experts and the source's weights")
    p.add_argument("--dtype", type=dtype_flag, default=None,
                   help="dtype experts are dequantised to before conversion: bf16, fp16, fp32 (default: the model's)")
