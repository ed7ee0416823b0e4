"""The model skeleton: transformers' own module tree, built without allocating a single weight.

Parameters stay on the meta device until the loader fills them from the checkpoint. Non-persistent buffers
(rotary inverse frequencies) are not in checkpoints, so they are recomputed on the host by the model's own
`_init_weights`, exactly as `from_pretrained` does; `move_buffers` then puts them on the main device with the
rest (left on the host, every forward would copy them over and wait for it).
transformers is imported when a skeleton is built: its model classes import its loading machinery (seconds), and
this module's helpers are imported by commands that never build one (`tiermoe place --num-layers ...`).
"""

from __future__ import annotations

import torch
from torch import nn


def build_skeleton(cfg, dtype: torch.dtype) -> nn.Module:
    """AutoModelForCausalLM for `cfg` with meta parameters and real (CPU) non-persistent buffers."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    _materialise_non_persistent_buffers(model)
    model.eval()
    return model


def _materialise_non_persistent_buffers(model: nn.Module) -> None:
    owners = []
    for module in model.modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        for name in names:
            module._buffers[name] = torch.zeros_like(module._buffers[name], device="cpu")
        if names:
            owners.append(module)
    with torch.no_grad():
        for module in owners:
            model._init_weights(module)


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer of `model`, persistent or not, onto `device` (dtype and persistence unchanged)."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers (`model.model.layers` in every supported family)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise RuntimeError(  # noqa: TRY004 - a model without decoder layers, not an argument of a wrong type
            f"{type(model).__name__} has no model.layers; tiermoe cannot find its decoder layers")
    return layers


def moe_block_attr(layer: nn.Module) -> str | None:
    """Name of the child of a decoder layer that is a routed MoE block (has `experts`), or None if dense."""
    for name, child in layer.named_children():
        if hasattr(child, "experts"):
            return name
    return None


def moe_block(layer: nn.Module, path: str) -> nn.Module | None:
    """The module at `path` in a decoder layer ("" = the layer) if it is a routed MoE block (holds an `experts`
    module), else None (a dense layer)."""
    try:
        block = layer.get_submodule(path) if path else layer
    except AttributeError:
        return None
    return block if isinstance(block._modules.get("experts"), nn.Module) else None


def meta_tensors(model: nn.Module):
    """(qualified name, owning module, leaf name, tensor, is_param) for every tensor still on the meta device."""
    seen = set()
    for mod_name, module in model.named_modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for leaf, t in store.items():
                if t is None or not t.is_meta or id(t) in seen:
                    continue
                seen.add(id(t))
                yield (f"{mod_name}.{leaf}" if mod_name else leaf), module, leaf, t, is_param
