"""Fused per-layer ops swapped in after the weights load: RMSNorms and routers whose weights live on the CPU become
one native call each (tiermoe.layers.fused_norm, fused_router, fused_grouped_router), cutting the
torch ops a decode step dispatches per layer. Bit for bit the same outputs; on a CUDA main device nothing is
swapped (the native calls run on the CPU), nor without the kernel library (no compiler, TIERMOE_CPU_ISA=torch),
nor for a model to fine-tune (the loader does not call this).
"""

from __future__ import annotations

from torch import nn

from tiermoe.experts.layer_ops import load_layer_ops
from tiermoe.layers.fused_grouped_router import fuse_grouped_routers
from tiermoe.layers.fused_norm import fuse_norms
from tiermoe.layers.fused_router import fuse_routers


def fuse_layer_ops(model: nn.Module) -> tuple[int, int]:
    """Swap the fused modules in; returns (norms, routers) swapped."""
    ops = load_layer_ops()
    if ops is None:
        return 0, 0
    return fuse_norms(model, ops), fuse_routers(model, ops) + fuse_grouped_routers(model, ops)
