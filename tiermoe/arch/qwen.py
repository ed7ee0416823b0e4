"""Qwen2-MoE, Qwen3-MoE and Qwen3-Next.

Qwen2-MoE and Qwen3-Next add one shared expert whose output is scaled by sigmoid(shared_expert_gate(x)).
Routing: softmax over all experts, top-k, renormalised only when `norm_topk_prob` is set.
"""

from __future__ import annotations

from tiermoe.arch.common import config_dtype, qwen_style_moe_layers, require
from tiermoe.arch.spec import ArchSpec, ExpertDiskLayout

PER_EXPERT = ExpertDiskLayout(block="mlp", proj_names=("gate_proj", "up_proj", "down_proj"), fused_kind="transformers")


def build_spec(cfg) -> ArchSpec:
    num_experts = require(cfg, "num_experts")
    shared = cfg.model_type in ("qwen2_moe", "qwen3_next")
    renorm = " -> renormalise" if getattr(cfg, "norm_topk_prob", False) else ""
    return ArchSpec(
        model_type=cfg.model_type,
        num_layers=cfg.num_hidden_layers,
        moe_layers=qwen_style_moe_layers(cfg, num_experts),
        num_experts=num_experts,
        top_k=require(cfg, "num_experts_per_tok"),
        hidden_size=cfg.hidden_size,
        expert_intermediate_size=require(cfg, "moe_intermediate_size"),
        router_kind=f"softmax -> top-k{renorm}",
        router_attr="gate",
        shared_kind="gated" if shared else "none",
        shared_intermediate_size=cfg.shared_expert_intermediate_size if shared else 0,
        activation="silu_glu",
        expert_bias=False,
        returns_router_scores=False,
        disk=PER_EXPERT,
        dtype=config_dtype(cfg),
    )
