"""GPT-OSS: every layer MoE; router linear with bias -> top-k -> softmax over the k.

Experts carry biases and a clamped SwiGLU (`swiglu_limit`, alpha 1.702, `(up + 1) * glu`), and checkpoints
store them fused, transposed and interleaved (`gate_up_proj [E, H, 2I]`, gate = even columns, up = odd).
The MoE block returns `(hidden, router_scores)`.
"""

from __future__ import annotations

from tiermoe.arch.common import config_dtype, require
from tiermoe.arch.spec import ArchSpec, ExpertDiskLayout

GPT_OSS_DISK = ExpertDiskLayout(block="mlp", proj_names=("gate_proj", "up_proj", "down_proj"), fused_kind="gpt_oss")


def build_spec(cfg) -> ArchSpec:
    return ArchSpec(
        model_type=cfg.model_type,
        num_layers=cfg.num_hidden_layers,
        moe_layers=tuple(range(cfg.num_hidden_layers)),
        num_experts=require(cfg, "num_local_experts"),
        top_k=require(cfg, "num_experts_per_tok"),
        hidden_size=cfg.hidden_size,
        expert_intermediate_size=cfg.intermediate_size,
        router_kind="linear + bias -> top-k -> softmax over k",
        router_attr="router",
        shared_kind="none",
        shared_intermediate_size=0,
        activation="gpt_oss_glu",
        expert_bias=True,
        returns_router_scores=True,
        disk=GPT_OSS_DISK,
        dtype=config_dtype(cfg),
    )
