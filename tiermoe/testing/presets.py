"""Model shapes: real presets for benchmark checkpoints, and tiny debug configs for tests, side by side.

Each entry is (model_type, config fields). Real presets copy the published config.json shapes; tiny ones keep
every structural feature of the family (dense first layers, groups, shared experts, biases) at toy sizes.
"""

from __future__ import annotations

from transformers import AutoConfig

from tiermoe.arch.zoo import moe_causal_lm_types
from tiermoe.errors import TiermoeError
from tiermoe.testing.tiny_configs import tiny_config

PRESETS: dict[str, tuple[str, dict]] = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
        tie_word_embeddings=False)),
    "qwen2-57b-a14b": ("qwen2_moe", dict(
        hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, num_experts=64, num_experts_per_tok=8,
        vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=False)),
    "qwen3-next-80b-a3b": ("qwen3_next", dict(
        hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=512,
        num_experts_per_tok=10, norm_topk_prob=True, vocab_size=151936, linear_num_value_heads=32,
        linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, full_attention_interval=4,
        tie_word_embeddings=False)),
    "mixtral-8x7b": ("mixtral", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False)),
    "deepseek-v2-lite": ("deepseek_v2", dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
        routed_scaling_factor=1.0, vocab_size=102400, tie_word_embeddings=False)),
    "deepseek-v3": ("deepseek_v3", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4, kv_lora_rank=512,
        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=2.5,
        norm_topk_prob=True, vocab_size=129280, tie_word_embeddings=False)),
    "glm-4.5-air": ("glm4_moe", dict(
        hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
        num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, partial_rotary_factor=0.5, vocab_size=151552, tie_word_embeddings=False)),
    "olmoe-1b-7b": ("olmoe", dict(
        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304, tie_word_embeddings=False)),
    "gpt-oss-20b": ("gpt_oss", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        vocab_size=201088, tie_word_embeddings=False)),
}

_TINY_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                    max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0)

TINY: dict[str, dict] = {
    "qwen3_moe": dict(_TINY_COMMON, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                      num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "qwen2_moe": dict(_TINY_COMMON, intermediate_size=128, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2),
    "qwen3_next": dict(_TINY_COMMON, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                       shared_expert_intermediate_size=32, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16),
    "mixtral": dict(_TINY_COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=8,
                    num_experts_per_tok=2),
    "deepseek_v2": dict(_TINY_COMMON, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=3, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        routed_scaling_factor=1.5),
    "deepseek_v3": dict(_TINY_COMMON, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=3, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
                        first_k_dense_replace=1, n_group=4, topk_group=2, kv_lora_rank=32, q_lora_rank=48,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5,
                        norm_topk_prob=True),
    "glm4_moe": dict(_TINY_COMMON, intermediate_size=128, moe_intermediate_size=32, head_dim=16,
                     num_hidden_layers=3, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                     first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True),
    "olmoe": dict(_TINY_COMMON, intermediate_size=48, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2),
    "gpt_oss": dict(_TINY_COMMON, intermediate_size=48, head_dim=16, num_hidden_layers=2, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=16,
                    rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
}


def make_config(arch: str, preset: str | None = None, layers: int | None = None, **overrides):
    """A transformers config for `arch`: a real preset's shapes, or the tiny debug config when `preset` is None."""

    if preset is not None:
        if preset not in PRESETS:
            raise TiermoeError(f"unknown preset '{preset}'; choose one of: {', '.join(PRESETS)}")
        model_type, fields = PRESETS[preset]
        if model_type != arch:
            raise TiermoeError(f"preset '{preset}' is a {model_type} model, not {arch}")
    elif arch in TINY:
        fields = TINY[arch]
    else:  # any other MoE family of the installed transformers: its default config shrunk, as the zoo tests it
        fields = _zoo_tiny_fields(arch, layers or overrides.get("num_hidden_layers"))
    fields = dict(fields, **overrides)
    if layers is not None:
        if layers < 1:
            raise TiermoeError(f"--layers must be at least 1, got {layers}")
        fields["num_hidden_layers"] = layers
        if "layer_types" in fields:
            fields["layer_types"] = fields["layer_types"][:layers]
    return AutoConfig.for_model(arch, **fields)


def _zoo_tiny_fields(arch: str, layers: int | None) -> dict:
    """The zoo's tiny config of `arch` (tiermoe.testing.tiny_configs), its per-layer lists (layer_types,
    mlp_layer_types, ...) repeated to `layers` layers."""
    if arch not in moe_causal_lm_types():
        raise TiermoeError(f"unknown architecture '{arch}'; choose one of: {', '.join(TINY)}, or another MoE model "
                           "type of the installed transformers (docs/architectures.md)")
    fields = tiny_config(arch).to_dict()
    for name in ("model_type", "transformers_version", "architectures"):
        fields.pop(name, None)
    if layers is not None and layers >= 1:
        per_layer = fields["num_hidden_layers"]
        for name, value in fields.items():
            if "layer" in name and isinstance(value, list) and len(value) == per_layer:  # not an eos id list
                fields[name] = [value[i % per_layer] for i in range(layers)]
        fields["num_hidden_layers"] = layers
    return fields
