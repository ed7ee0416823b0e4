"""A LoRA SFT run from start to finish: what `tiermoe finetune` does, as a library call.

load the hybrid model for training -> LoRA (PEFT on attention and dense projections, tiermoe's on every routed
expert) -> chat examples (tiermoe.training.chat_sft) -> held-out loss before -> steps (tiermoe.training.sft_loop),
checkpoints every `save_every` steps and after the last -> held-out loss after -> the adapter in OUT (PEFT's
layout) and OUT/metrics.json. With `resume`, the newest checkpoint in OUT is restored (adapter, optimizer,
schedule, data position, generators) and the run continues exactly as if it had never stopped; the settings that
decide the result must be the same (only `steps` may grow). Progress goes to the caller through FinetuneHooks.

Two settings trade memory for time and leave the result alone: `gradient_checkpointing` (each decoder layer keeps
only its input and is recomputed in backward) and `expert_chunk` (the CPU tier's span of tokens,
tiermoe.training.long_context). They are what `tiermoe fit --train` predicts the longest context for; both are
saved with the run's settings, and a resume may change them (a run that ran out of memory continues with them on).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tiermoe.arch import detect, load_config, text_config
from tiermoe.bundled import resolve_model
from tiermoe.config import CPUConfig
from tiermoe.errors import TiermoeError
from tiermoe.layers.routed_autograd import DEFAULT_CHUNK
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.adapter_io import save_adapter
from tiermoe.training.chat_sft import ChatEncoder, SFTBatches, encode_all
from tiermoe.training.checkpoints import (
    TrainerState,
    checkpoint_dirs,
    latest_checkpoint,
    load_checkpoint_model,
    load_checkpoint_state,
    read_state,
    save_checkpoint,
)
from tiermoe.training.finetune_data import finetune_data
from tiermoe.training.long_context import check_expert_chunk, set_expert_chunk
from tiermoe.training.lora import apply_lora
from tiermoe.training.sft_loop import (
    OptimizerSettings,
    StepRecord,
    evaluate,
    make_optimizer,
    make_schedule,
    train_steps,
)

METRICS_FILE = "metrics.json"
DEFAULT_MAX_LENGTH = 512
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Saved with the run's settings but free to change on resume: they decide memory and time, not the adapter
# (checkpointing recomputes the same values; spans change only the order of fp32 sums, tests/test_cli_finetune.py).
MEMORY_SETTINGS = ("gradient_checkpointing", "expert_chunk")


@dataclass(frozen=True)
class FinetuneConfig:
    dataset: str  # sharegpt | demo | a .json / .jsonl file
    out_dir: Path
    steps: int
    lora_rank: int
    model: str | Path | None = None  # None: the bundled demo model
    lora_alpha: float | None = None  # None: 2 x rank (KT's default)
    lora_dropout: float = 0.0
    lora_targets: str | tuple[str, ...] = "all-linear"  # PEFT's target_modules
    expert_lora: bool = True  # LoRA on every routed expert (KT's default SFT mode), whatever lora_targets says
    batch_size: int = 4
    max_length: int | None = None  # tokens per conversation; None: DEFAULT_MAX_LENGTH within the model's positions
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    save_every: int = 0  # 0: a checkpoint after the last step only
    eval_every: int = 0  # 0: held-out loss before and after only
    keep_checkpoints: int = 2  # 0: keep all
    resume: bool = False
    seed: int = 0
    placement: object = None  # anything load_hybrid_model takes
    cpu: CPUConfig = field(default_factory=CPUConfig)
    gpu_device: str = "cpu"
    dtype: torch.dtype | None = None  # None: fp32 on the CPU device, else the checkpoint's dtype
    eval_batch_size: int = 8
    gradient_checkpointing: bool = False  # each decoder layer recomputed in backward (transformers' checkpointing)
    expert_chunk: int = DEFAULT_CHUNK  # tokens the CPU tier computes at a time in training; 0: the whole context
    progress: bool = True  # the loader's progress bar

    @property
    def alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    def run_settings(self, model_dir: Path) -> dict:
        """What decides the trained adapter: a resume must repeat it (`steps` and MEMORY_SETTINGS aside), and how
        it was trained. As JSON stores it (lists)."""
        return json.loads(json.dumps({"model": str(model_dir.resolve()), "dataset": self.dataset,
                "lora_rank": self.lora_rank,
                "lora_alpha": self.alpha, "lora_dropout": self.lora_dropout, "lora_targets": self.lora_targets,
                "expert_lora": self.expert_lora, "batch_size": self.batch_size, "max_length": self.max_length,
                "seed": self.seed, "dtype": DTYPE_NAMES.get(self.dtype, str(self.dtype)), "steps": self.steps,
                "gradient_checkpointing": self.gradient_checkpointing, "expert_chunk": self.expert_chunk,
                **{f"optimizer.{k}": v for k, v in asdict(self.optimizer).items()}}))


@dataclass
class FinetuneHooks:
    """What the caller hears of a run (a progress bar, log lines); every hook optional."""

    message: Callable[[str], None] | None = None
    start: Callable[[int, int], None] | None = None  # (first step, last step)
    step: Callable[[StepRecord], None] | None = None
    evaluated: Callable[[int, float], None] | None = None  # (step, held-out loss)
    saved: Callable[[Path], None] | None = None

    def say(self, text: str) -> None:
        if self.message:
            self.message(text)


@dataclass(frozen=True)
class FinetuneResult:
    out_dir: Path
    heldout_name: str
    heldout_before: float
    heldout_after: float
    history: list[dict]
    evals: list[dict]
    steps: int
    resumed_from: int  # 0 when started fresh


def _peft_config(config: FinetuneConfig):
    try:
        from peft import LoraConfig  # the [train] extra
    except ImportError:
        raise TiermoeError("fine-tuning needs PEFT: pip install 'tiermoe[train]'") from None
    targets = config.lora_targets if isinstance(config.lora_targets, str) else list(config.lora_targets)
    # PEFT adapts parameters (transformers 5's fused routed experts, its routers) with a ParamWrapper, which has no
    # dropout: PEFT refuses a config that asks for it, so such an adapter could be neither saved nor loaded by PEFT
    if config.lora_dropout and config.expert_lora:
        raise TiermoeError("LoRA dropout does not go with LoRA on the routed experts (PEFT adapts their fused "
                           "parameters without dropout and refuses such a config): pass --lora-dropout 0, or "
                           "--no-expert-lora with module --lora-targets")
    if config.lora_dropout and targets == "all-linear":
        raise TiermoeError("LoRA dropout needs module targets: all-linear includes the router, a parameter PEFT "
                           "adapts without dropout; pass e.g. --lora-targets q_proj,k_proj,v_proj,o_proj")
    return LoraConfig(r=config.lora_rank, lora_alpha=config.alpha, lora_dropout=config.lora_dropout,
                      target_modules=targets)


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise TiermoeError(f"'{model_dir}' has no usable tokenizer ({str(err).splitlines()[0]})") from None


def _checked(config: FinetuneConfig, model_dir: Path, hooks: FinetuneHooks) -> FinetuneConfig:
    """`config` with its max length and dtype settled, once its values and OUT are checked against the model
    and, on resume, against the checkpoint's settings (before anything is loaded)."""
    model_config = load_config(model_dir)
    positions = getattr(text_config(model_config), "max_position_embeddings", None)
    if config.max_length is None:
        config = dataclasses.replace(config, max_length=min(DEFAULT_MAX_LENGTH, positions or DEFAULT_MAX_LENGTH))
    if config.dtype is None:
        config = dataclasses.replace(config, dtype=torch.float32 if config.gpu_device == "cpu"
                                     else detect(model_config).dtype)
    check_expert_chunk(config.expert_chunk)
    if positions and config.max_length > positions:
        raise TiermoeError(f"max length {config.max_length} is beyond the model's {positions} positions")
    found = checkpoint_dirs(config.out_dir)
    if found and not config.resume:
        raise TiermoeError(f"'{config.out_dir}' already holds checkpoints ({found[-1].name}); pass --resume to "
                           "continue that run, or choose another --out")
    if config.resume and not found:
        raise TiermoeError(f"--resume: '{config.out_dir}' holds no checkpoint to continue from")
    if config.resume:
        saved = read_state(found[-1])
        _check_same_run(saved.run, config.run_settings(model_dir), hooks)
        if saved.step >= config.steps:
            raise TiermoeError(f"the newest checkpoint is at step {saved.step}; --steps {config.steps} leaves nothing "
                               "to do")
    return config


def _check_same_run(saved: dict, now: dict, hooks: FinetuneHooks) -> None:
    for key, value in now.items():
        if key in MEMORY_SETTINGS and key in saved and saved[key] != value:
            hooks.say(f"resuming with {key} {value!r} (the checkpoint's run had {saved[key]!r}): memory and time "
                      "change, the results do not")
        elif key != "steps" and key not in MEMORY_SETTINGS and saved.get(key) != value:
            raise TiermoeError(f"the checkpoint was made with {key} {saved.get(key)!r}, this run has {value!r}: "
                               "resume with the same settings")
    if saved.get("steps") != now["steps"]:
        hooks.say(f"resuming a {saved.get('steps')}-step run for {now['steps']} steps: the learning-rate schedule "
                  "follows the new count from here on")


def run_finetune(config: FinetuneConfig, hooks: FinetuneHooks | None = None) -> FinetuneResult:
    hooks = hooks or FinetuneHooks()
    model_dir = resolve_model(config.model)
    config = _checked(config, model_dir, hooks)
    data = finetune_data(model_dir, config.dataset)
    hooks.say(f"data: {len(data.train):,} training conversations; held out: {data.heldout_name}")
    tokenizer = _tokenizer(model_dir)
    hybrid = load_hybrid_model(model_dir, config.placement, gpu_device=config.gpu_device, dtype=config.dtype,
                               cpu=config.cpu, progress=config.progress, trainable=True)
    with hybrid:  # the CPU tier's threads stop with it
        set_expert_chunk(hybrid, config.expert_chunk)
        return _train(config, hooks, model_dir, hybrid, tokenizer, data)


def _train(config: FinetuneConfig, hooks: FinetuneHooks, model_dir: Path, hybrid, tokenizer, data) -> FinetuneResult:
    checkpoint = latest_checkpoint(config.out_dir) if config.resume else None
    if checkpoint is not None:
        model = load_checkpoint_model(hybrid, checkpoint)
    else:
        torch.manual_seed(config.seed)  # LoRA's initial factors
        model = apply_lora(hybrid, _peft_config(config), experts=config.expert_lora)
    if config.gradient_checkpointing:  # active in train mode only: evaluate() runs the plain forward
        # newer transformers call it activation checkpointing (the old name warns); older ones have the old name only
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    encoder = ChatEncoder(tokenizer, config.max_length)
    batches = SFTBatches(data.train, encoder, config.batch_size, config.seed)
    heldout = encode_all(data.heldout, encoder)
    optimizer = make_optimizer(model, config.optimizer)
    schedule = make_schedule(optimizer, config.steps, config.optimizer)
    run = config.run_settings(model_dir)
    config.out_dir.mkdir(parents=True, exist_ok=True)

    if checkpoint is not None:
        state = load_checkpoint_state(checkpoint, model, optimizer, schedule)
        batches.load_state_dict(state.data)
        state.run = run
        hooks.say(f"resumed from {checkpoint.name} (step {state.step})")
    else:
        state = TrainerState(run=run)
        hooks.say(f"held-out loss before: scoring {len(heldout)} conversations")
        state.evals.append({"step": 0, "loss": evaluate(model, heldout, config.eval_batch_size, batches.pad_id)})
    resumed_from = state.step
    if hooks.evaluated and not resumed_from:
        hooks.evaluated(0, state.evals[0]["loss"])

    def after_step(record: StepRecord) -> None:
        state.step = record.step
        state.history.append(asdict(record))
        state.data = batches.state_dict()
        if hooks.step:
            hooks.step(record)
        if config.eval_every and record.step % config.eval_every == 0 and record.step < config.steps:
            loss = evaluate(model, heldout, config.eval_batch_size, batches.pad_id)
            state.evals.append({"step": record.step, "loss": loss})
            if hooks.evaluated:
                hooks.evaluated(record.step, loss)
        if record.step == config.steps or (config.save_every and record.step % config.save_every == 0):
            path = save_checkpoint(config.out_dir, state, model, optimizer, schedule, config.keep_checkpoints)
            if hooks.saved:
                hooks.saved(path)

    if hooks.start:
        hooks.start(state.step, config.steps)
    started = time.perf_counter()
    train_steps(model, batches.next_batch, optimizer, schedule, state.step, config.steps, config.optimizer,
                after_step)
    hooks.say(f"trained {config.steps - resumed_from} steps in {time.perf_counter() - started:.0f} s; held-out "
              "loss after: scoring")
    after = evaluate(model, heldout, config.eval_batch_size, batches.pad_id)
    state.evals.append({"step": config.steps, "loss": after})
    if hooks.evaluated:
        hooks.evaluated(config.steps, after)
    save_adapter(model, config.out_dir)
    result = FinetuneResult(config.out_dir, data.heldout_name, state.evals[0]["loss"], after, state.history,
                            state.evals, config.steps, resumed_from)
    metrics = {"heldout": data.heldout_name, "heldout_loss_before": result.heldout_before,
               "heldout_loss_after": after, "settings": run, "evals": state.evals, "history": state.history}
    (config.out_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    return result
