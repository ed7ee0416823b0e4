"""OLMoE: every layer MoE, softmax -> top-k (renormalised if `norm_topk_prob`), experts use `intermediate_size`."""

from __future__ import annotations

from tiermoe.arch.common import config_dtype, require
from tiermoe.arch.qwen import PER_EXPERT
from tiermoe.arch.spec import ArchSpec


def build_spec(cfg) -> ArchSpec:
    renorm = " -> renormalise" if getattr(cfg, "norm_topk_prob", False) else ""
    return ArchSpec(
        model_type=cfg.model_type,
        num_layers=cfg.num_hidden_layers,
        moe_layers=tuple(range(cfg.num_hidden_layers)),
        num_experts=require(cfg, "num_experts"),
        top_k=require(cfg, "num_experts_per_tok"),
        hidden_size=cfg.hidden_size,
        expert_intermediate_size=cfg.intermediate_size,
        router_kind=f"softmax -> top-k{renorm}",
        router_attr="gate",
        shared_kind="none",
        shared_intermediate_size=0,
        activation="silu_glu",
        expert_bias=False,
        returns_router_scores=False,
        disk=PER_EXPERT,
        dtype=config_dtype(cfg),
    )
