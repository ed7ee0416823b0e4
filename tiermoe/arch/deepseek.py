"""DeepSeek-V2, DeepSeek-V3 and GLM4-MoE: dense first layers, shared experts added without a gate.

V2 routes by softmax then greedy or group-limited-greedy top-k; V3 and GLM4-MoE by sigmoid plus
`e_score_correction_bias`, top-`topk_group` of `n_group` groups, top-k, optional renormalisation, times
`routed_scaling_factor`. The router module does all of this, so tiermoe only needs to keep it.
"""

from __future__ import annotations

from tiermoe.arch.common import config_dtype, deepseek_style_moe_layers, require
from tiermoe.arch.qwen import PER_EXPERT
from tiermoe.arch.spec import ArchSpec


def _router_kind(cfg) -> str:
    if cfg.model_type == "deepseek_v2":
        method = getattr(cfg, "topk_method", "greedy")
        return f"softmax -> {method} top-k (n_group={cfg.n_group}, topk_group={cfg.topk_group}) x scaling"
    renorm = " -> renormalise" if getattr(cfg, "norm_topk_prob", False) else ""
    return f"sigmoid + bias -> group top-k (n_group={cfg.n_group}, topk_group={cfg.topk_group}) -> top-k{renorm} x scaling"


def build_spec(cfg) -> ArchSpec:
    moe_i = require(cfg, "moe_intermediate_size")
    n_shared = getattr(cfg, "n_shared_experts", 0) or 0
    return ArchSpec(
        model_type=cfg.model_type,
        num_layers=cfg.num_hidden_layers,
        moe_layers=deepseek_style_moe_layers(cfg),
        num_experts=require(cfg, "n_routed_experts"),
        top_k=require(cfg, "num_experts_per_tok"),
        hidden_size=cfg.hidden_size,
        expert_intermediate_size=moe_i,
        router_kind=_router_kind(cfg),
        router_attr="gate",
        shared_kind="plain" if n_shared else "none",
        shared_intermediate_size=moe_i * n_shared,
        activation="silu_glu",
        expert_bias=False,
        returns_router_scores=False,
        disk=PER_EXPERT,
        dtype=config_dtype(cfg),
    )
