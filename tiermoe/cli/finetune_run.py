"""tiermoe finetune's run: the settings from the flags and ACCELERATE_KT_*, a progress bar over the steps, the
held-out loss before and after, and the loss-curve plot."""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from tiermoe.bundled import resolve_model
from tiermoe.cli.cpu_flags import cpu_from_args
from tiermoe.cli.extras import DATASET_MODULES, DEMO_SPLIT_MODULES, require_modules
from tiermoe.cli.placement_flags import placement_config_from_args
from tiermoe.cli.plots import plot_loss_curve
from tiermoe.config import check_device
from tiermoe.errors import TiermoeError
from tiermoe.placement.plan import PlacementPlan
from tiermoe.training.finetune import FinetuneConfig, FinetuneHooks, run_finetune
from tiermoe.training.finetune_data import is_demo_model
from tiermoe.training.kt_env import read_kt_settings, training_placement
from tiermoe.training.sft_loop import OptimizerSettings

PLOT_FILE = "loss_curve.png"


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


def finetune_modules(dataset: str, model: str | None) -> list[str]:
    """The optional modules a run needs: PEFT (the train extra), and the data packages a named dataset is read from
    (sharegpt with the demo model, and demo, mean the demo's own split of ShareGPT and Chit-Chat)."""
    demo_split = dataset == "demo" or (dataset == "sharegpt" and is_demo_model(resolve_model(model)))
    data = list(DEMO_SPLIT_MODULES) if demo_split else [DATASET_MODULES[dataset]] if dataset in DATASET_MODULES else []
    return ["peft", *data]


def config_from_args(args) -> tuple[FinetuneConfig, tuple[str, ...], int | None]:
    """(the run's settings, KT notes to show, torch threads) from the flags and ACCELERATE_KT_*."""
    cpu = cpu_from_args(args)
    kt = read_kt_settings(os.environ, num_gpu_experts=args.num_gpu_experts, lora_rank=args.lora_rank,
                          lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, expert_dtype=cpu.expert_dtype,
                          threads=cpu.threads, max_length=args.max_length,
                          gradient_checkpointing=args.gradient_checkpointing)
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
        eval_batch_size=args.eval_batch_size, gradient_checkpointing=bool(kt.gradient_checkpointing),
        expert_chunk=args.expert_chunk,
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
    require_modules("tiermoe finetune", finetune_modules(args.dataset, args.model))  # before a model loads
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
