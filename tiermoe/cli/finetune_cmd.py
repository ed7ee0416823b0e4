"""tiermoe finetune's flags: LoRA SFT of a hybrid model on chat data, with KTransformers' ACCELERATE_KT_* settings
(run: finetune_run)."""

from __future__ import annotations

import argparse

from tiermoe.cli.choices import (
    DEFAULT_EXPERT_CHUNK,
    DTYPE_NAMES,
    FINETUNE_MAX_LENGTH,
    MAX_LORA_RANK,
)
from tiermoe.cli.cpu_flags import add_cpu_flags
from tiermoe.cli.flags import (
    add_command,
    dtype_flag,
    expert_chunk,
    finite_float,
    non_negative_float,
    non_negative_int,
    output_dir,
    positive_float,
    positive_int,
    seed_int,
)
from tiermoe.cli.placement_flags import add_placement_flags

MAX_STEPS = 10_000_000
MAX_BATCH = 4096


def bounded_int(high: int, what: str):
    def parse(value: str) -> int:
        number = positive_int(value)
        if number > high:
            raise argparse.ArgumentTypeError(f"expected {what} between 1 and {high:,}, got {number:,}")
        return number
    return parse


def dropout(value: str) -> float:
    number = finite_float(value)
    if not 0 <= number < 1:
        raise argparse.ArgumentTypeError(f"expected a dropout probability in [0, 1), got {value}")
    return number


def learning_rate(value: str) -> float:
    number = positive_float(value)
    if number > 1:
        raise argparse.ArgumentTypeError(f"expected a learning rate in (0, 1], got {value}")
    return number


def add_parser(sub) -> None:
    p = add_command(
        sub, "finetune",
        "LoRA fine-tuning (SFT) of a hybrid model on chat data: LoRA on attention, dense projections and every "
        "routed expert of both tiers, loss on the assistant's replies only (the model's chat template). A progress "
        "bar shows loss and tokens/s; the held-out loss is measured before and after; OUT gets the adapter (PEFT's "
        "layout), checkpoints, metrics.json and a loss-curve plot. KTransformers' ACCELERATE_KT_* variables are "
        "read with KT's meanings (NUM_GPU_EXPERTS, LORA_RANK, LORA_ALPHA, LORA_DROPOUT, EXPERT_WEIGHT_FORMAT, "
        "BACKEND, NUM_THREADS, MODEL_MAX_LENGTH, TRAIN_MODE, ACTIVATION_POLICY, ...); a flag wins over its "
        "variable. For long contexts, --gradient-checkpointing and --expert-chunk are what `tiermoe fit --train` "
        "predicts the longest context for (it prints the command).",
        "tiermoe finetune --dataset demo --lora-rank 8 --steps 300 --out runs/demo-lora",
        "tiermoe finetune --dataset demo --lora-rank 8 --steps 300 --out runs/demo-lora --resume   # after a stop",
        "tiermoe finetune --model /models/Qwen3-30B-A3B --gpu-device cuda:0 --dataset chats.jsonl --lora-rank 16 "
        "--steps 2000 --max-length 2048 --num-gpu-experts 8 --init-expert-location stats.pt --out runs/qwen",
        "ACCELERATE_KT_LORA_RANK=8 ACCELERATE_KT_NUM_GPU_EXPERTS=2 tiermoe finetune --dataset sharegpt --steps 200 "
        "--out runs/kt",
        "tiermoe finetune --model /models/Qwen3-30B-A3B --dataset chats.jsonl --lora-rank 16 --steps 500 "
        "--batch-size 1 --max-length 32768 --num-gpu-experts 0 --dtype bf16 --gradient-checkpointing --expert-chunk "
        "4096 --out runs/long   # as tiermoe fit --train prints it",
    )
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--gpu-device", default="cpu",
                   help="device of the GPU tier, non-expert weights and adapters: cuda, cuda:N or cpu (default cpu)")
    p.add_argument("--dtype", type=dtype_flag, default=None,
                   help=f"compute dtype of the frozen model: {', '.join(DTYPE_NAMES)} (default: fp32 with --gpu-device "
                        "cpu, else the checkpoint's); adapters are always fp32")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", required=True,
                   help="sharegpt, demo (the demo model's training split) or a .json / .jsonl file of "
                        '{"messages": [...]} or ShareGPT {"conversations": [...]} records. With the demo model, '
                        "sharegpt means its own training split and the held-out loss is on its held-out split")
    g.add_argument("--max-length", type=positive_int, default=None,
                   help=f"tokens per conversation, cut beyond (default ACCELERATE_KT_MODEL_MAX_LENGTH, else "
                        f"{FINETUNE_MAX_LENGTH} or the model's positions if fewer; at most the model's positions)")
    g.add_argument("--batch-size", type=bounded_int(MAX_BATCH, "conversations per step"), default=4,
                   help="conversations per optimizer step (default 4)")
    g = p.add_argument_group("memory (long contexts: docs/fine-tuning.md#long-contexts)")
    g.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="keep only each decoder layer's input and recompute the layer in backward: less memory per "
                        "token, about one more forward per step, the same gradients (default off, or "
                        "ACCELERATE_KT_ACTIVATION_POLICY's gpu=recompute), e.g. --gradient-checkpointing")
    g.add_argument("--expert-chunk", type=expert_chunk, default=DEFAULT_EXPERT_CHUNK,
                   help=f"tokens the CPU tier's experts compute at a time, forward and backward (default "
                        f"{DEFAULT_EXPERT_CHUNK}; 0: the whole context); what they hold follows it, not the context, "
                        "e.g. --expert-chunk 2048")
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-rank", type=bounded_int(MAX_LORA_RANK, "a LoRA rank"), default=None,
                   help="LoRA rank (required, unless ACCELERATE_KT_LORA_RANK gives it)")
    g.add_argument("--lora-alpha", type=positive_float, default=None, help="LoRA alpha (default 2 x rank, as KT)")
    g.add_argument("--lora-dropout", type=dropout, default=None, help="LoRA dropout (default 0)")
    g.add_argument("--lora-targets", default="all-linear",
                   help="PEFT target_modules: all-linear (default: attention, router and routed experts) or "
                        "comma-separated module names")
    g.add_argument("--no-expert-lora", action="store_true", help="no LoRA on the routed experts")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=bounded_int(MAX_STEPS, "optimizer steps"), required=True,
                   help="optimizer steps (one batch each)")
    g.add_argument("--lr", type=learning_rate, default=2e-4, help="peak learning rate of AdamW (default 2e-4)")
    g.add_argument("--warmup-steps", type=non_negative_int, default=None,
                   help="linear warmup, then cosine to 10%% of --lr (default: 5%% of --steps)")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.0, help="AdamW weight decay (default 0)")
    g.add_argument("--max-grad-norm", type=non_negative_float, default=1.0,
                   help="clip the adapters' gradient norm (default 1; 0 = no clipping)")
    g.add_argument("--seed", type=seed_int, default=0, help="LoRA initialisation, data order, dropout (default 0)")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=output_dir, required=True,
                   help="directory for the adapter, checkpoints, metrics.json and loss_curve.png")
    g.add_argument("--save-every", type=bounded_int(MAX_STEPS, "steps"), default=None,
                   help="checkpoint every K steps (default: after the last step only)")
    g.add_argument("--keep-checkpoints", type=non_negative_int, default=2,
                   help="newest checkpoints kept (default 2; 0 = all)")
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    g.add_argument("--eval-every", type=bounded_int(MAX_STEPS, "steps"), default=None,
                   help="held-out loss every K steps too (default: before and after only)")
    g.add_argument("--eval-batch-size", type=bounded_int(MAX_BATCH, "conversations"), default=8,
                   help="conversations per held-out batch (default 8)")
    add_placement_flags(p)
    p.set_defaults(strategy=None)  # frequency with statistics, else KT's first n experts of each layer
    add_cpu_flags(p)
