"""tiermoe finetune: LoRA SFT of a hybrid model on chat data, with KTransformers' ACCELERATE_KT_* settings."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from tiermoe.cli.cpu_flags import add_cpu_flags, cpu_from_args
from tiermoe.cli.flags import (
    DTYPES,
    add_command,
    dtype_flag,
    finite_float,
    non_negative_float,
    non_negative_int,
    output_dir,
    positive_float,
    positive_int,
    seed_int,
)
from tiermoe.cli.placement_flags import add_placement_flags, placement_config_from_args
from tiermoe.cli.plots import plot_loss_curve
from tiermoe.config import check_device
from tiermoe.errors import TiermoeError
from tiermoe.placement.plan import PlacementPlan
from tiermoe.training.finetune import DEFAULT_MAX_LENGTH, FinetuneConfig, FinetuneHooks, run_finetune
from tiermoe.training.kt_env import read_kt_settings, training_placement
from tiermoe.training.lora import MAX_RANK
from tiermoe.training.sft_loop import OptimizerSettings

MAX_STEPS = 10_000_000
MAX_BATCH = 4096
PLOT_FILE = "loss_curve.png"


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
        "BACKEND, NUM_THREADS, MODEL_MAX_LENGTH, TRAIN_MODE, ...); a flag wins over its variable.",
        "tiermoe finetune --dataset demo --lora-rank 8 --steps 300 --out runs/demo-lora",
        "tiermoe finetune --dataset demo --lora-rank 8 --steps 300 --out runs/demo-lora --resume   # after a stop",
        "tiermoe finetune --model /models/Qwen3-30B-A3B --gpu-device cuda:0 --dataset chats.jsonl --lora-rank 16 "
        "--steps 2000 --max-length 2048 --num-gpu-experts 8 --init-expert-location stats.pt --out runs/qwen",
        "ACCELERATE_KT_LORA_RANK=8 ACCELERATE_KT_NUM_GPU_EXPERTS=2 tiermoe finetune --dataset sharegpt --steps 200 "
        "--out runs/kt",
    )
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--gpu-device", default="cpu",
                   help="device of the GPU tier, non-expert weights and adapters: cuda, cuda:N or cpu (default cpu)")
    p.add_argument("--dtype", type=dtype_flag, default=None,
                   help=f"compute dtype of the frozen model: {', '.join(DTYPES)} (default: fp32 with --gpu-device "
                        "cpu, else the checkpoint's); adapters are always fp32")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", required=True,
                   help="sharegpt, demo (the demo model's training split) or a .json / .jsonl file of "
                        '{"messages": [...]} or ShareGPT {"conversations": [...]} records. With the demo model, '
                        "sharegpt means its own training split and the held-out loss is on its held-out split")
    g.add_argument("--max-length", type=positive_int, default=None,
                   help=f"tokens per conversation, cut beyond (default ACCELERATE_KT_MODEL_MAX_LENGTH, else "
                        f"{DEFAULT_MAX_LENGTH} or the model's positions if fewer; at most the model's positions)")
    g.add_argument("--batch-size", type=bounded_int(MAX_BATCH, "conversations per step"), default=4,
                   help="conversations per optimizer step (default 4)")
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-rank", type=bounded_int(MAX_RANK, "a LoRA rank"), default=None,
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


def placement_from(args, num_gpu_experts: int | None):
    """Flags first (--plan, a ratio or a memory budget, --num-gpu-experts), else ACCELERATE_KT_NUM_GPU_EXPERTS."""
    if args.plan:
        return PlacementPlan.load(args.plan)
    if args.num_gpus != 1:
        raise TiermoeError("fine-tuning runs in one process on one GPU: --num-gpus must be 1")
    if args.gpu_experts_ratio is not None or args.gpu_memory_gb is not None:
        args.strategy = args.strategy or ("frequency" if args.init_expert_location else "uniform")
        return placement_config_from_args(args)
    return training_placement(num_gpu_experts, args.init_expert_location, args.strategy)


def config_from_args(args) -> tuple[FinetuneConfig, tuple[str, ...], int | None]:
    """(the run's settings, KT notes to show, torch threads) from the flags and ACCELERATE_KT_*."""
    cpu = cpu_from_args(args)
    kt = read_kt_settings(os.environ, num_gpu_experts=args.num_gpu_experts, lora_rank=args.lora_rank,
                          lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, expert_dtype=cpu.expert_dtype,
                          threads=cpu.threads, max_length=args.max_length)
    if kt.lora_rank is None:
        raise TiermoeError("--lora-rank is required (or set ACCELERATE_KT_LORA_RANK)")
    targets = args.lora_targets if args.lora_targets == "all-linear" else \
        tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    if not targets:
        raise TiermoeError("--lora-targets names no module")
    warmup = args.warmup_steps if args.warmup_steps is not None else args.steps // 20
    optimizer = OptimizerSettings(lr=args.lr, weight_decay=args.weight_decay, warmup_steps=min(warmup, args.steps),
                                  max_grad_norm=args.max_grad_norm)
    config = FinetuneConfig(
        dataset=args.dataset, out_dir=Path(args.out), steps=args.steps, lora_rank=kt.lora_rank, model=args.model,
        lora_alpha=kt.alpha, lora_dropout=kt.lora_dropout, lora_targets=targets,
        expert_lora=kt.expert_lora and not args.no_expert_lora, batch_size=args.batch_size,
        max_length=kt.max_length, optimizer=optimizer, save_every=args.save_every or 0,
        eval_every=args.eval_every or 0, keep_checkpoints=args.keep_checkpoints, resume=args.resume, seed=args.seed,
        placement=placement_from(args, kt.num_gpu_experts), gpu_device=check_device(args.gpu_device),
        cpu=dataclasses.replace(cpu, expert_dtype=kt.expert_dtype, threads=kt.threads), dtype=args.dtype,
        eval_batch_size=args.eval_batch_size,
    )
    return config, kt.notes, kt.torch_threads


class ProgressBar:
    """tqdm over the steps: loss (mean of the last 10 steps) and tokens/s (since this process started training)."""

    def __init__(self):
        self.bar = None
        self.recent: list[float] = []
        self.tokens = 0
        self.seconds = 0.0

    def start(self, first: int, last: int) -> None:
        self.bar = tqdm(total=last, initial=first, desc="finetune", unit="step", dynamic_ncols=True)

    def step(self, record) -> None:
        self.recent = (self.recent + [record.loss])[-10:]
        self.tokens += record.tokens
        self.seconds += record.seconds
        self.bar.set_postfix(loss=f"{sum(self.recent) / len(self.recent):.4f}",
                             tok_s=f"{self.tokens / max(self.seconds, 1e-9):,.0f}", lr=f"{record.lr:.2e}",
                             refresh=False)
        self.bar.update(1)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def quiet_known_warnings() -> None:
    """A warning the user can do nothing about: transformers' deprecation of a name PEFT still calls."""
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def run(args) -> int:
    quiet_known_warnings()
    config, notes, torch_threads = config_from_args(args)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    if torch_threads:
        torch.set_num_threads(torch_threads)
    bar = ProgressBar()
    hooks = FinetuneHooks(
        message=bar.write, start=bar.start, step=bar.step,
        evaluated=lambda step, loss: bar.write(f"step {step}: held-out loss {loss:.4f}"),
        saved=lambda path: bar.write(f"checkpoint {path}"),
    )
    try:
        result = run_finetune(config, hooks)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"the same command with --resume continues from the newest checkpoint in "
                                f"{config.out_dir}") from None
    finally:
        bar.close()
    plot = plot_loss_curve(result.history, result.evals, config.out_dir / PLOT_FILE,
                           f"LoRA r={config.lora_rank} on {config.dataset}: held-out {result.heldout_before:.4f} -> "
                           f"{result.heldout_after:.4f}")
    change = result.heldout_after - result.heldout_before
    print(f"held-out loss on reply tokens ({result.heldout_name}): {result.heldout_before:.4f} before -> "
          f"{result.heldout_after:.4f} after ({change:+.4f} nats)")
    print(f"adapter: {config.out_dir} (PEFT layout); loss curve: {plot}; metrics: {config.out_dir / 'metrics.json'}")
    return 0
