"""Placement: decide which routed experts live on the GPU tier (pure functions over tensors) and describe it
(PlacementPlan, the one plan format every command reads)."""

from tiermoe.placement.global_topk import generate_gpu_experts_masks
from tiermoe.placement.mask import all_cpu_mask, validate_mask
from tiermoe.placement.plan import PlacementPlan

__all__ = ["PlacementPlan", "all_cpu_mask", "generate_gpu_experts_masks", "validate_mask"]
