"""KTransformers' MOEArchConfig for every architecture tiermoe supports, derived from tiermoe's own ArchSpec.

Attribute paths are those of the transformers 5 module tree (`model.layers[i].<moe_layer_attr>` holds
`<router_attr>` and `<experts_attr>`; Mixtral's block is `mlp` there, `block_sparse_moe` only on disk).
`weight_names` are the per-expert projection names of the checkpoint (gate, up, down), as KTransformers gives
them; `fused_weight_names` the fused parameters of the transformers experts module.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermoe.arch import SUPPORTED_MODEL_TYPES, detect, text_config
from tiermoe.errors import TiermoeError

_ROUTER_TYPES = {
    "deepseek_v2": "deepseek_gate", "deepseek_v3": "deepseek_gate", "glm4_moe": "glm4_moe_gate",
    "gpt_oss": "linear_bias_topk_softmax",
}


class MOEArchNotSupportedError(TiermoeError):
    """The model's architecture has no MoE config here (KTransformers raises KTAMXModelNotSupportedError)."""


@dataclass(frozen=True)
class MOEArchConfig:
    moe_layer_attr: str
    router_attr: str
    experts_attr: str
    weight_names: tuple[str, str, str]
    expert_num: int
    intermediate_size: int
    num_experts_per_tok: int
    has_shared_experts: bool = False
    router_type: str = "linear"
    fused_weight_names: tuple[str, ...] = ("gate_up_proj", "down_proj")
    layers_attr: str = "model.layers"
    moe_layers: tuple[int, ...] = ()


def get_moe_arch_config(config) -> MOEArchConfig:
    """MOEArchConfig of a transformers config (or a model carrying `.config`)."""
    config = getattr(config, "config", config)
    model_type = getattr(text_config(config), "model_type", None)
    try:
        spec = detect(config)
    except TiermoeError:
        raise MOEArchNotSupportedError(f"no MoE architecture config for model_type '{model_type}'; supported: "
                                       f"{', '.join(SUPPORTED_MODEL_TYPES)}") from None
    fused = ("gate_up_proj", "down_proj")
    if spec.expert_bias:
        fused += ("gate_up_proj_bias", "down_proj_bias")
    return MOEArchConfig(
        moe_layer_attr="mlp", router_attr=spec.router_attr, experts_attr="experts", weight_names=spec.disk.proj_names,
        expert_num=spec.num_experts, intermediate_size=spec.expert_intermediate_size,
        num_experts_per_tok=spec.top_k, has_shared_experts=spec.shared_kind != "none",
        router_type=_ROUTER_TYPES.get(spec.model_type, "linear"), fused_weight_names=fused,
        moe_layers=spec.moe_layers)
