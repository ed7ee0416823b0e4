"""`tiermoe fit --train`: the longest context one LoRA training step fits in host memory, with its terms
(tiermoe.training.context_memory measures them)."""

from __future__ import annotations

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
    terms = context_memory(cfg, tiers, compute, cpu_format, rank=rank,
                           expert_chunk=DEFAULT_CHUNK if args.expert_chunk is None else args.expert_chunk)
    s = model.spec
    what = (f"{model.name} ({s.model_type}), {s.num_layers} layers, {s.num_moe_layers} MoE layers x {s.num_experts} "
            f"experts, {str(compute).removeprefix('torch.')}, every expert on the CPU tier ({model.cpu_format})")
    rows = [("model", what), *terms.rows(budget)]
    limit = getattr(cfg, "max_position_embeddings", None)
    if isinstance(limit, int) and terms.longest_context(budget) > limit:  # memory is not what bounds it then
        rows.append(("train: the model's own limit", f"{limit:,} tokens (max_position_embeddings)"))
    width = max(len(k) for k, _ in rows) + 2
    print("\n".join(f"{k:<{width}}{v}" for k, v in rows))
    return 0 if terms.longest_context(budget) > 0 else 1
