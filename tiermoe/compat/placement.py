"""KTransformers' placement helpers on tiermoe's planner: masks, device maps, and the environment settings."""

from __future__ import annotations

import torch
from torch import nn

from tiermoe.errors import TiermoeError
from tiermoe.model.plan_source import ENV_NUM_GPU_EXPERTS, num_gpu_experts_from_env  # noqa: F401  (re-exported)
from tiermoe.placement.global_topk import generate_gpu_experts_masks  # noqa: F401  (re-exported)
from tiermoe.placement.plan import PlacementPlan


def build_device_map(mask, gpu_device: str = "cuda:0") -> dict[tuple[int, int], str]:
    """{(layer, expert): device} for every routed position: "cpu", or the GPU (a plan's rank r -> cuda:r)."""
    if isinstance(mask, PlacementPlan):
        assignment = mask.assignment
        return {(layer, e): ("cpu" if r < 0 else f"cuda:{r}")
                for layer, row in enumerate(assignment.tolist()) for e, r in enumerate(row)}
    mask = torch.as_tensor(mask).bool()
    return {(layer, e): (gpu_device if on else "cpu")
            for layer, row in enumerate(mask.tolist()) for e, on in enumerate(row)}


def move_non_experts_to_gpu(model: nn.Module, moe_config=None, device: str | torch.device | None = None) -> int:
    """Move everything but the routed experts to `device` (default cuda:0): embeddings, norms, attention,
    routers, shared experts, dense MLPs and lm_head. Routed experts stay where they are. Returns the bytes moved.

    Called as KTransformers does, `move_non_experts_to_gpu(model, moe_config, "cuda:0")` (moe_config an
    MOEArchConfig or None; its `experts_attr` names the routed-expert modules), or `(model, "cuda:0")` /
    `(model, device="cuda:0")`. Works on a transformers MoE model (its fused `experts` modules stay) and on
    tiermoe's hybrid model (whose routed experts live in the tiers, outside the module tree).
    """
    if isinstance(moe_config, (str, torch.device, int)) and not isinstance(moe_config, bool):
        if device is not None:
            raise TiermoeError(f"move_non_experts_to_gpu got two devices: {moe_config!r} and {device!r}")
        moe_config, device = None, moe_config
    if not isinstance(model, nn.Module):  # tiermoe's HybridModel wraps the module tree
        model = model.model
    experts_attr = getattr(moe_config, "experts_attr", None) or "experts"
    device = torch.device("cuda:0" if device is None else device)
    experts = {id(m) for name, m in model.named_modules() if name.endswith(f".{experts_attr}")}
    inside_experts = set()
    for module in model.modules():
        if id(module) in experts:
            inside_experts.update(id(m) for m in module.modules())
    moved = 0
    for module in model.modules():
        if id(module) in inside_experts:
            continue
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for key, tensor in list(store.items()):
                if tensor is None or tensor.device == device:
                    continue
                moved += tensor.numel() * tensor.element_size()
                value = tensor.to(device)
                store[key] = nn.Parameter(value, requires_grad=tensor.requires_grad) if is_param else value
    return moved
