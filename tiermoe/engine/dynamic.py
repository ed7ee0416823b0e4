"""Turning on layerwise GPU prefill and dynamic placement for a loaded engine."""

from __future__ import annotations

import logging

import torch

from tiermoe.config import DynamicPlacementConfig
from tiermoe.engine.placement_manager import PlacementManager, warn_if_never_fires
from tiermoe.experts.copier import AsyncCopier
from tiermoe.layers.prefill_streamer import PrefillStreamer
from tiermoe.placement.adaptive_policy import AdaptivePolicy
from tiermoe.placement.budget import GIB
from tiermoe.placement.pass_cost import PassCostModel, expert_cost_model
from tiermoe.placement.policies import KTDynamicPolicy

log = logging.getLogger(__name__)


def make_policy(config: DynamicPlacementConfig, num_layers: int, num_experts: int, cost: PassCostModel,
                calibration_LE: torch.Tensor | None = None, ranks: int = 1):
    """The policy `config` names (None: static). With several GPU ranks adaptive moves GPU slots between layers
    only when its settings say cross_layer=True (tiermoe.distributed.swaps applies such swaps on every rank)."""
    if config.policy == "kt-dynamic":
        return KTDynamicPolicy(config.prefill_threshold)
    if config.policy == "adaptive":
        settings = config.adaptive.for_ranks(ranks)
        if ranks > 1:
            log.info("adaptive placement on %d ranks: %s", ranks, "cross-layer swaps on" if settings.cross_layer
                     else "swaps stay within each layer (--adaptive-cross-layer moves GPU slots between layers)")
        return AdaptivePolicy(num_layers, num_experts, cost, settings, calibration_LE)
    return None


def enable_dynamic_placement(engine, config: DynamicPlacementConfig, cost: PassCostModel | None = None,
                             copier: AsyncCopier | None = None,
                             calibration_LE: torch.Tensor | None = None) -> PlacementManager | None:
    """Attach the prefill streamer to every MoE block and a placement manager to the engine (None if static).
    cost: what the adaptive policy decides with (default: the cost model with assumed figures for this model's
    experts, tiermoe.placement.pass_cost.expert_cost_model)."""
    hybrid = engine.hybrid
    spec = hybrid.spec
    warn_if_never_fires(config.policy == "kt-dynamic", config.prefill_threshold)
    bytes_per_expert = spec.bytes_per_expert(hybrid.expert_dtype)
    if config.prefill_threshold:
        streamer = PrefillStreamer(hybrid.gpu_device, config.prefill_threshold, int(config.prefill_buffer_gb * GIB),
                                   bytes_per_expert, spec.num_experts)
        for block in hybrid.blocks.values():
            block.prefill_streamer = streamer
    cost = cost or expert_cost_model(bytes_per_expert, 2.0 * spec.params_per_expert)
    ranks = 1 if hybrid.share is None else hybrid.share.num_ranks
    policy = make_policy(config, spec.num_layers, spec.num_experts, cost, calibration_LE, ranks)
    if policy is None:
        return None
    manager = PlacementManager(hybrid, policy, copier)
    engine.add_recorder(manager)
    engine.after_step_hooks.append(manager.after_step)
    return manager
