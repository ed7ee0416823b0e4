"""Mixtral: every layer MoE, softmax -> top-k -> renormalise, experts stored on disk as
`block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down)."""

from __future__ import annotations

from tiermoe.arch.common import config_dtype, require
from tiermoe.arch.spec import ArchSpec, ExpertDiskLayout

MIXTRAL_DISK = ExpertDiskLayout(block="block_sparse_moe", proj_names=("w1", "w3", "w2"), fused_kind="transformers")


def build_spec(cfg) -> ArchSpec:
    return ArchSpec(
        model_type=cfg.model_type,
        num_layers=cfg.num_hidden_layers,
        moe_layers=tuple(range(cfg.num_hidden_layers)),
        num_experts=require(cfg, "num_local_experts"),
        top_k=require(cfg, "num_experts_per_tok"),
        hidden_size=cfg.hidden_size,
        expert_intermediate_size=cfg.intermediate_size,
        router_kind="softmax -> top-k -> renormalise",
        router_attr="gate",
        shared_kind="none",
        shared_intermediate_size=0,
        activation="silu_glu",
        expert_bias=False,
        returns_router_scores=False,
        disk=MIXTRAL_DISK,
        dtype=config_dtype(cfg),
    )
