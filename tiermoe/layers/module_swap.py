"""Putting our modules in the place of transformers' ones after loading (fused norms, routers, attention, layers)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap_modules(model: nn.Module, wanted: Callable[[nn.Module], bool],
                 replacement: Callable[[nn.Module], nn.Module]) -> int:
    """Put `replacement(module)` in the place of every module of `model` (not the model itself) that is `wanted`;
    returns how many were swapped."""
    chosen = [(name, module) for name, module in model.named_modules() if name and wanted(module)]
    for name, module in chosen:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, replacement(module))
    return len(chosen)
