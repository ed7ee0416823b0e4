"""Placement: which routed experts live on the GPU tier. Pure functions over tensors."""

from tiermoe.placement.mask import all_cpu_mask, validate_mask

__all__ = ["all_cpu_mask", "validate_mask"]
