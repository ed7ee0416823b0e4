"""The supervised fine-tuning loop: AdamW on the trainable parameters, warmup then cosine, loss on reply tokens.

Pure-ish on purpose: the loop takes a model, a source of batches, an optimizer, a schedule and a callback, and
knows nothing of files, progress bars or checkpoints (tiermoe.training.finetune wires those). One step is one
batch: forward, the mean cross-entropy over the batch's labelled tokens (the replies, tiermoe.training.chat_sft),
backward, gradient clipping, AdamW, the schedule. Everything random in a step comes from torch's global generator
(LoRA dropout), so a run resumed with the generator's state, the optimizer's and the batches' position continues
exactly as the uninterrupted run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.errors import TiermoeError
from tiermoe.training.chat_sft import IGNORE_INDEX, ChatExample, collate


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    final_lr_ratio: float = 0.1  # cosine decays to this share of lr at the last step
    max_grad_norm: float = 1.0  # 0: no clipping

    def __post_init__(self):
        if not (math.isfinite(self.lr) and 0 < self.lr <= 1):
            raise TiermoeError(f"learning rate must be in (0, 1], got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise TiermoeError(f"weight decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise TiermoeError(f"warmup steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.final_lr_ratio <= 1:
            raise TiermoeError(f"final learning-rate ratio must be in [0, 1], got {self.final_lr_ratio}")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise TiermoeError(f"max gradient norm must be >= 0, got {self.max_grad_norm}")


@dataclass(frozen=True)
class StepRecord:
    step: int  # 1-based: the number of optimizer steps taken after this one
    loss: float  # mean over the batch's reply tokens
    lr: float
    grad_norm: float
    target_tokens: int  # labelled (reply) tokens in the batch
    tokens: int  # tokens the model read (padding excluded)
    seconds: float


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TiermoeError("the model has no trainable parameter (apply LoRA first)")
    return params


def make_optimizer(model: nn.Module, settings: OptimizerSettings) -> torch.optim.AdamW:
    return torch.optim.AdamW(trainable_parameters(model), lr=settings.lr, betas=settings.betas,
                             weight_decay=settings.weight_decay)


def lr_factor(step: int, total_steps: int, settings: OptimizerSettings) -> float:
    """Share of the peak learning rate at 0-based `step`: linear warmup, then cosine to final_lr_ratio."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    progress = min(1.0, (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps))
    return settings.final_lr_ratio + (1 - settings.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_schedule(optimizer: torch.optim.Optimizer, total_steps: int,
                  settings: OptimizerSettings) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, settings))


def reply_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(sum of the next-token cross-entropy over labelled tokens, their count); float32 whatever the model's dtype."""
    device = next(model.parameters()).device
    input_ids = batch["input_ids"].to(device)
    logits = model(input_ids=input_ids, attention_mask=batch["attention_mask"].to(device), use_cache=False).logits
    targets = batch["labels"][:, 1:].to(device)
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, int((targets != IGNORE_INDEX).sum())


def train_steps(model: nn.Module, next_batch: Callable[[], dict[str, torch.Tensor]],
                optimizer: torch.optim.Optimizer, schedule, first_step: int, last_step: int,
                settings: OptimizerSettings, after_step: Callable[[StepRecord], None] | None = None) -> None:
    """Optimizer steps first_step+1 .. last_step (the schedule already at first_step); `after_step` sees each."""
    params = trainable_parameters(model)
    model.train()
    for step in range(first_step, last_step):
        start = time.perf_counter()
        batch = next_batch()
        loss_sum, count = reply_loss_sum(model, batch)
        if count == 0:  # chat_sft keeps only examples with reply tokens; the first one always keeps one
            raise TiermoeError("a batch without reply tokens")
        loss = loss_sum / count
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm or math.inf))
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        schedule.step()
        record = StepRecord(step=step + 1, loss=float(loss.detach()), lr=lr, grad_norm=grad_norm,
                            target_tokens=count, tokens=int(batch["attention_mask"].sum()),
                            seconds=time.perf_counter() - start)
        if after_step is not None:
            after_step(record)


@torch.no_grad()
def evaluate(model: nn.Module, examples: Iterable[ChatExample], batch_size: int, pad_id: int) -> float:
    """Mean cross-entropy (nats) over every reply token of `examples` (token-weighted, not per example)."""
    ordered = sorted(examples, key=lambda e: len(e.input_ids))  # batches of similar lengths: little padding
    if not ordered:
        raise TiermoeError("no held-out example to evaluate on")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i in range(0, len(ordered), batch_size):
            loss_sum, n = reply_loss_sum(model, collate(ordered[i:i + batch_size], pad_id))
            total += float(loss_sum)
            count += n
    finally:
        model.train(was_training)
    return total / count
