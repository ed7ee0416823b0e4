"""tiermoe record's flags: run dataset prompts through a hybrid model and write expert activation statistics
(run: record_run)."""

from __future__ import annotations

from tiermoe.cli.cpu_flags import add_cpu_flags
from tiermoe.cli.flags import (
    add_command,
    dtype_flag,
    fraction,
    non_negative_float,
    non_negative_int,
    output_file_new_dirs,
    positive_int,
    running_count,
    seed_int,
)
from tiermoe.cli.placement_flags import add_placement_flags
from tiermoe.cli.recorder_flags import add_recorder_flags
from tiermoe.data.prompts import SPLITS
from tiermoe.data.registry import DATASETS


def add_parser(sub) -> None:
    p = add_command(
        sub, "record",
        "Run prompts from a dataset through a hybrid model (batched, chat template applied when the tokenizer has "
        "one) and record which experts every MoE layer routes to. The file feeds `tiermoe place "
        "--init-expert-location` (SGLang's logical_count format) and `tiermoe stats`. Datasets: "
        + ", ".join(DATASETS) + ", or a .json/.jsonl file. Without --out the file goes to "
        "$TIERMOE_EXPERT_DISTRIBUTION_RECORDER_DIR (else $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp), in "
        "SGLang's layout for the mode; GPU-tier snapshots go beside it as gpu_expert_distribution_*.pt.",
        "tiermoe record --dataset sharegpt --num-prompts 200 --out stats.pt",
        "tiermoe record --model /models/Qwen3-30B-A3B --gpu-device cuda:0 --dataset gsm8k --num-prompts 500 "
        "--max-tokens 256 --out gsm8k.pt",
        "tiermoe record --dataset sharegpt --split train --num-prompts 500 --out train.pt && "
        "tiermoe record --dataset sharegpt --split heldout --num-prompts 100 --out heldout.pt && "
        "tiermoe stats train.pt --eval heldout.pt",
        "tiermoe record --dataset prompts.jsonl --num-prompts 50 --mode per_token --out trace.pt",
        "tiermoe record --dataset gpqa --num-prompts 20 --plan plan.json --record-kt-gpu-expert-distribution "
        "--out run.pt",
    )
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--gpu-device", "--kt-gpu-device", dest="gpu_device", default="cpu",
                   help="device of the GPU tier and non-expert weights: cuda, cuda:N or cpu (default cpu)")
    p.add_argument("--dtype", type=dtype_flag, default=None, help="bf16, fp32 or fp16 (default: the checkpoint's)")
    p.add_argument("--dataset", required=True, help=f"{', '.join(DATASETS)}, or a .json / .jsonl file")
    p.add_argument("--num-prompts", type=positive_int, required=True, help="prompts to run")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens to generate per prompt (default 128)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the prompt sample and split (default 0)")
    p.add_argument("--split", choices=SPLITS, default="all",
                   help="all prompts (default), or the train / heldout part of a seeded split by conversation")
    p.add_argument("--heldout-fraction", type=fraction, default=0.1,
                   help="share of conversations in the heldout part (default 0.1)")
    p.add_argument("--min-chars", type=non_negative_int, default=1, help="skip prompts shorter than this")
    p.add_argument("--max-chars", type=positive_int, default=None, help="skip prompts longer than this")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="skip prompts with more tokens (default: the context length less --max-tokens; at most "
                        "the context length less one)")
    p.add_argument("--batch-size", "--max-running", dest="batch_size", type=running_count, default=16,
                   help="sequences advanced together in one step (default 16; at most 4096, and as many as the "
                        "device's free memory holds 2 tokens of KV cache each)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--raw", action="store_true", help="feed prompts as plain text, without the chat template")
    p.add_argument("--prefix-cache", action="store_true",
                   help="reuse the KV pages of prompt prefixes earlier prompts computed (off by default, so every "
                        "routed token is recorded once; the dump's run info says which)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--out", type=output_file_new_dirs,
                   help="the statistics file to write (.pt; missing directories are created)")
    add_recorder_flags(p, mode_flags=("--mode",), default_mode="stat", default_buffer_size=-1)
    add_placement_flags(p)
    add_cpu_flags(p)
