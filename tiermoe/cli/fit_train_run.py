"""`tiermoe fit --train`: the longest context one LoRA training step fits in host memory, with its terms
(tiermoe.training.context_memory measures them), and the `tiermoe finetune` command that trains at that length:
the prediction is for one conversation per step, every expert on the CPU tier, gradient checkpointing on and the
CPU tier in spans of `expert_chunk` tokens, so the command names each of those flags."""

from __future__ import annotations

import shlex
from pathlib import Path

from transformers import AutoConfig

from tiermoe.arch import detect
from tiermoe.bundled import resolve_model
from tiermoe.errors import TiermoeError
from tiermoe.fit import CONFIG_DTYPES, model_bytes
from tiermoe.layers.routed_autograd import DEFAULT_CHUNK
from tiermoe.placement.budget import GIB
from tiermoe.placement.free_memory import available_ram
from tiermoe.training.context_memory import context_memory
from tiermoe.training.finetune import DTYPE_NAMES
from tiermoe.training.lora import MAX_RANK

DEFAULT_RANK = 16  # tiermoe finetune's default --lora-rank


def _config(path: Path):
    config_file = path if path.is_file() else path / "config.json"
    if config_file.suffix != ".json" or not config_file.is_file():
        raise TiermoeError(f"--train measures the model from its config.json: '{path}' is neither a checkpoint "
                           "directory with one nor a .json config file")
    try:
        return AutoConfig.from_pretrained(str(config_file), local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise TiermoeError(f"{config_file} could not be read as a transformers config: {err}") from None


def finetune_command(model: str | None, rank: int, expert_chunk: int, length: int, dtype_name: str | None,
                     cpu_format: str | None) -> str:
    """The `tiermoe finetune` command whose step is the one measured: `length` tokens, one conversation a step,
    every expert on the CPU tier, LoRA of `rank` on all linears and every expert (finetune's defaults), the compute
    dtype named (finetune's own default on the CPU is fp32). A config file alone has no weights to train: then the
    model is a placeholder."""
    if model is not None and Path(model).suffix == ".json":
        model = "CHECKPOINT_DIR"
    flags = ([] if model is None else ["--model", shlex.quote(model)]) + [
        "--dataset", "FILE", "--steps", "N", "--out", "DIR", "--lora-rank", str(rank), "--batch-size", "1",
        "--max-length", str(length), "--num-gpu-experts", "0", *(["--dtype", dtype_name] if dtype_name else []),
        *(["--cpu-expert-dtype", cpu_format] if cpu_format else []),
        "--gradient-checkpointing", "--expert-chunk", str(expert_chunk)]
    return " ".join(["tiermoe finetune", *flags])


def run_train(args) -> int:
    path = resolve_model(args.model)
    model = model_bytes(path, args.dtype, args.cpu_expert_dtype, args.non_expert_dtype, args.head_dtype)
    cfg = _config(Path(path))
    compute = CONFIG_DTYPES[args.dtype][0] if args.dtype else detect(cfg).dtype
    rank = args.lora_rank or DEFAULT_RANK
    if rank > MAX_RANK:
        raise TiermoeError(f"--lora-rank {rank} is above the largest rank tiermoe trains ({MAX_RANK})")
    budget = int(args.ram_gb * GIB) if args.ram_gb is not None else available_ram()
    if budget is None:
        raise TiermoeError("this machine's available memory is unknown: give the host memory with --ram-gb")
    cpu_format = args.cpu_expert_dtype if args.cpu_expert_dtype else None
    tiers = model.non_expert + model.total_experts * model.cpu_bytes_per_expert + model.load_buffer
    chunk = DEFAULT_CHUNK if args.expert_chunk is None else args.expert_chunk
    terms = context_memory(cfg, tiers, compute, cpu_format, rank=rank, expert_chunk=chunk)
    s = model.spec
    what = (f"{model.name} ({s.model_type}), {s.num_layers} layers, {s.num_moe_layers} MoE layers x {s.num_experts} "
            f"experts, {str(compute).removeprefix('torch.')}, every expert on the CPU tier ({model.cpu_format})")
    rows = [("model", what), *terms.rows(budget)]
    longest = terms.longest_context(budget)
    limit = getattr(cfg, "max_position_embeddings", None)
    if isinstance(limit, int) and longest > limit:  # memory is not what bounds it then
        rows.append(("train: the model's own limit", f"{limit:,} tokens (max_position_embeddings)"))
        longest = limit
    if longest > 1:  # finetune's --max-length: at least one token and its next
        rows.append(("train it with", finetune_command(args.model, rank, chunk, longest, DTYPE_NAMES.get(compute),
                                                       cpu_format)))
    width = max(len(k) for k, _ in rows) + 2
    print("\n".join(f"{k:<{width}}{v}" for k, v in rows))
    return 0 if longest > 0 else 1
