"""Connect placement to a checkpoint: its shape and real bytes (from headers), and any placement -> a mask."""

from __future__ import annotations

from pathlib import Path

import torch

from tiermoe.arch import detect, load_config, text_config
from tiermoe.config import PlacementConfig
from tiermoe.errors import TiermoeError
from tiermoe.fit import bytes_from_headers
from tiermoe.placement.budget import kv_bytes_per_token
from tiermoe.placement.mask import validate_mask
from tiermoe.placement.plan import PlacementPlan
from tiermoe.placement.planner import PlacementTarget, make_plan


def placement_target(model_dir: str | Path, dtype: torch.dtype | None = None) -> PlacementTarget:
    """Shape and bytes of a checkpoint, read from config.json and the weights' headers only: the bytes the loader
    will hold (GGUF tensors in the compute dtype, FP8 ones as stored), as `tiermoe fit` counts them."""
    config = load_config(model_dir)
    spec = detect(config)
    dtype = dtype or spec.dtype
    non_expert, per_expert = bytes_from_headers(Path(model_dir), dtype, config, spec)
    return PlacementTarget(
        num_layers=spec.num_layers, num_experts=spec.num_experts, moe_layers=spec.moe_layers,
        model_type=spec.model_type, bytes_per_expert=per_expert, non_expert_bytes=non_expert,
        kv_bytes_per_token=kv_bytes_per_token(text_config(config), dtype.itemsize),
    )


CHECKPOINT_MASK_KEY = "gpu_expert_mask"


def default_placement(model_dir: str | Path):
    """Placement when the caller gives none: a `gpu_expert_mask` the checkpoint carries (KTransformers' workflow
    registers it as a buffer; dense rows all True in its convention, ignored here), else TIERMOE_NUM_GPU_EXPERTS /
    ACCELERATE_KT_NUM_GPU_EXPERTS experts per MoE layer, else None (every expert on the CPU tier)."""
    from tiermoe.compat.placement import num_gpu_experts_from_env
    from tiermoe.model.gguf_checkpoint import open_checkpoint

    with open_checkpoint(model_dir) as ckpt:
        if CHECKPOINT_MASK_KEY in ckpt:
            return ckpt.read(CHECKPOINT_MASK_KEY).bool()
    per_layer = num_gpu_experts_from_env()
    return PlacementConfig(num_gpu_experts=per_layer) if per_layer else None


def resolve_mask(placement, model_dir: str | Path, spec, gpu_device: str = "cpu") -> torch.Tensor | None:
    """A bool mask [L, E] for one process from a mask, a PlacementPlan or a PlacementConfig; None asks
    default_placement (a mask in the checkpoint, the environment, or all CPU)."""
    if placement is None:
        placement = default_placement(model_dir)
    if placement is None:
        return None
    if isinstance(placement, PlacementConfig):
        placement = make_plan(placement, placement_target(model_dir), gpu_device)
    if isinstance(placement, PlacementPlan):
        placement.check_model(spec)
        if placement.num_gpus > 1:
            raise TiermoeError(f"this plan spreads experts over {placement.num_gpus} GPUs; one process runs one "
                               "GPU (use a plan made with --num-gpus 1)")
        return placement.mask
    return validate_mask(placement, spec)
