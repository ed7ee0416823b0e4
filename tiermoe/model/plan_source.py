"""Where a placement plan comes from: whatever the user gave, turned into a PlacementPlan exactly once.

The edge (the CLI, `LLM`, `RankModel`, tiermoe.compat) calls `resolve_plan` with what the user gave: a
PlacementPlan, a PlacementConfig (planned here against the checkpoint's real shape and bytes), a bool mask
[L, E] (one GPU), an integer assignment [L, E] (-1 CPU tier, r GPU rank r), a KTransformers-style device map
(`{(layer, expert): "cuda"|"cpu"}` or module names, tiermoe.placement.device_map), or None (then a `gpu_expert_mask`
the checkpoint carries, or the KT environment variables, or every expert on the CPU tier). Everything after the
edge (the fit check, the loader, the ranks, dynamic placement, `/placement`) takes the plan it returns.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from tiermoe.arch import ArchSpec, detect, load_config, text_config
from tiermoe.config import PlacementConfig
from tiermoe.errors import TiermoeError
from tiermoe.model.gguf_checkpoint import open_checkpoint
from tiermoe.model.held_bytes import held_from_headers
from tiermoe.placement.device_map import assignment_from_device_map
from tiermoe.placement.kv_layout import kv_layout
from tiermoe.placement.mask import validate_mask
from tiermoe.placement.plan import PlacementPlan
from tiermoe.placement.planner import PlacementTarget, make_plan
from tiermoe.stats.io import load_counts

# KTransformers' fine-tuning path registers the mask as a buffer of this name in the model it saves.
CHECKPOINT_MASK_KEY = "gpu_expert_mask"
# GPU experts per MoE layer from the environment: ours, then KTransformers' (its SFT launcher sets it).
ENV_NUM_GPU_EXPERTS = ("TIERMOE_NUM_GPU_EXPERTS", "ACCELERATE_KT_NUM_GPU_EXPERTS")


def placement_target(model_dir: str | Path, dtype: torch.dtype | None = None) -> PlacementTarget:
    """Shape and bytes of a checkpoint, read from config.json and the weights' headers only: the bytes the loader
    will hold (GGUF tensors in the compute dtype, FP8 ones as stored), as `tiermoe fit` counts them."""
    config = load_config(model_dir)
    spec = detect(config)
    dtype = dtype or spec.dtype
    held = held_from_headers(Path(model_dir), dtype, config, spec)
    kv = kv_layout(text_config(config), dtype.itemsize)
    return PlacementTarget(
        num_layers=spec.num_layers, num_experts=spec.num_experts, moe_layers=spec.moe_layers,
        model_type=spec.model_type, bytes_per_expert=held.gpu_expert, non_expert_bytes=held.non_expert,
        kv_bytes_per_token=kv.full_per_token, kv_layout=kv,
        fp8_dequant_matrix=held.fp8_matrix, fp8_dequant_expert=held.fp8_expert,
    )


def num_gpu_experts_from_env(environ: Mapping[str, str] | None = None) -> int:
    """GPU experts per MoE layer for scripts and trainers: TIERMOE_NUM_GPU_EXPERTS (or KTransformers'
    ACCELERATE_KT_NUM_GPU_EXPERTS); 0 when unset (every expert on the CPU tier)."""
    environ = os.environ if environ is None else environ
    for name in ENV_NUM_GPU_EXPERTS:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                number = int(value)
            except ValueError:
                raise TiermoeError(f"{name}={value!r} is not an integer (GPU experts per MoE layer)") from None
            if number < 0:
                raise TiermoeError(f"{name}={number} must be >= 0")
            return number
    return 0


def default_placement(model_dir: str | Path):
    """Placement when the caller gives none: a `gpu_expert_mask` the checkpoint carries (dense rows all True in
    KTransformers' convention, ignored here), else GPU experts per MoE layer from the environment, else None
    (every expert on the CPU tier)."""
    with open_checkpoint(model_dir) as ckpt:
        if CHECKPOINT_MASK_KEY in ckpt:
            return ckpt.read(CHECKPOINT_MASK_KEY).bool()
    per_layer = num_gpu_experts_from_env()
    return PlacementConfig(num_gpu_experts=per_layer) if per_layer else None


def plan_from_config(config: PlacementConfig, model_dir: str | Path, gpu_device: str | None = None,
                     gpu_memory: list[tuple[int, int]] | None = None) -> PlacementPlan:
    """Plan `config` against the checkpoint: its shape, its real bytes, and the statistics file it names.
    gpu_memory: --gpu-memory-gb auto's (free bytes, margin) of every GPU, each measured by its own rank."""
    target = placement_target(model_dir)
    counts = None
    if config.init_expert_location:
        counts = load_counts(config.init_expert_location, target.num_layers, target.num_experts)
    return make_plan(config, target, counts, gpu_device, gpu_memory)


def resolve_plan(placement, model_dir: str | Path, spec: ArchSpec, num_gpus: int = 1,
                 gpu_device: str = "cpu", gpu_memory: list[tuple[int, int]] | None = None) -> PlacementPlan:
    """The PlacementPlan for `num_gpus` GPU ranks from any placement a user may give (see the module docstring),
    checked against the model: its shape, no GPU experts in dense layers, and exactly `num_gpus` GPUs.
    gpu_memory: see plan_from_config (several ranks measure their own GPUs; one process measures `gpu_device`)."""
    if placement is None:
        placement = default_placement(model_dir)
    if placement is None:
        plan = PlacementPlan.all_cpu(spec.num_layers, spec.num_experts, num_gpus=num_gpus)
    elif isinstance(placement, PlacementPlan):
        plan = placement
    elif isinstance(placement, PlacementConfig):
        if placement.num_gpus != num_gpus:
            raise TiermoeError(f"the placement asks for {placement.num_gpus} GPU(s) but {num_gpus} rank(s) run")
        plan = plan_from_config(placement, model_dir, gpu_device, gpu_memory)
    elif isinstance(placement, Mapping):
        plan = PlacementPlan(assignment_from_device_map(placement, spec, num_gpus), num_gpus=num_gpus,
                             strategy="device-map", model_type=spec.model_type)
    else:
        plan = _plan_from_tensor(placement, spec, num_gpus)
    if plan.num_gpus != num_gpus:
        hint = " (use a plan made with --num-gpus 1)" if num_gpus == 1 else ""
        raise TiermoeError(f"the plan spreads experts over {plan.num_gpus} GPU(s) but {num_gpus} rank(s) run"
                           f"{hint}")
    plan.check_model(spec)
    return plan


def _plan_from_tensor(placement, spec: ArchSpec, num_gpus: int) -> PlacementPlan:
    """A bool mask [L, E] (one GPU; dense rows cleared) or an integer assignment [L, E] as a plan."""
    tensor = torch.as_tensor(placement)
    if num_gpus == 1:
        return PlacementPlan.from_mask(validate_mask(tensor, spec), model_type=spec.model_type)
    if tensor.dtype == torch.bool:
        raise TiermoeError("a bool mask places experts on one GPU; with several ranks give a PlacementPlan, a "
                           "PlacementConfig with num_gpus, or an integer assignment (-1 CPU, r GPU rank r)")
    return PlacementPlan(tensor, num_gpus=num_gpus, model_type=spec.model_type)
