"""The GPU-tier mask: bool [L, E], True = the expert lives on the GPU tier; rows of dense layers are all False."""

from __future__ import annotations

import torch

from tiermoe.arch.spec import ArchSpec
from tiermoe.errors import TiermoeError


def all_cpu_mask(spec: ArchSpec) -> torch.Tensor:
    """[L, E] all False: every routed expert on the CPU tier."""
    return torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)


def validate_mask(mask, spec: ArchSpec) -> torch.Tensor:
    """Check a user's mask against the model and return it as a CPU bool tensor [L, E].

    Accepts a bool tensor, a 0/1 integer tensor, or nested lists. Rows of dense layers carry no routed experts,
    so whatever they hold (KTransformers marks them all True) is cleared.
    """
    if mask is None:
        return all_cpu_mask(spec)
    mask = torch.as_tensor(mask).detach().to("cpu")
    expected = (spec.num_layers, spec.num_experts)
    if tuple(mask.shape) != expected:
        raise TiermoeError(
            f"placement mask has shape {list(mask.shape)}, expected [{expected[0]}, {expected[1]}] "
            "(num_hidden_layers x experts per layer) for this model"
        )
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
            raise TiermoeError(f"placement mask must be bool (or 0/1 integers), got dtype {mask.dtype}")
        mask = mask.bool()
    return mask & spec.moe_row_mask()[:, None]
