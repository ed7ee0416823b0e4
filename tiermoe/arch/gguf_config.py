"""A transformers config from GGUF metadata (llama.cpp's `{arch}.*` keys), for the MoE families tiermoe runs.

GGUF names the architecture in `general.architecture` and keeps the shapes under `{arch}.` keys. llama.cpp's
conventions that are not in the metadata are filled in as its own code fixes them: qwen3moe always renormalises
the top-k weights, qwen2moe never does; Mixtral is a `llama` GGUF with experts. Which layers are MoE follows
from the tensors present (`blk.N.ffn_gate_inp`), not from a rule, so dense-first layouts load as written.
"""

from __future__ import annotations

from tiermoe.errors import TiermoeError

# GGUF architecture -> transformers model_type (llama only when it has experts)
GGUF_ARCHS = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral", "mixtral": "mixtral",
              "deepseek2": "deepseek_v3"}  # deepseek2 with softmax gating (expert_gating_func 1) is DeepSeek-V2

_COMMON = {  # GGUF key under {arch}. -> config field
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "expert_used_count": "num_experts_per_tok",
}
_PER_ARCH = {
    "qwen3_moe": {"expert_count": "num_experts", "expert_feed_forward_length": "moe_intermediate_size",
                  "attention.key_length": "head_dim"},
    "qwen2_moe": {"expert_count": "num_experts", "expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "mixtral": {"expert_count": "num_local_experts", "expert_feed_forward_length": "intermediate_size"},
    "deepseek": {"expert_count": "n_routed_experts", "expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_count": "n_shared_experts", "leading_dense_block_count": "first_k_dense_replace",
                 "expert_weights_scale": "routed_scaling_factor", "expert_weights_norm": "norm_topk_prob",
                 "attention.q_lora_rank": "q_lora_rank", "attention.kv_lora_rank": "kv_lora_rank",
                 "rope.dimension_count": "qk_rope_head_dim", "expert_group_count": "n_group",
                 "expert_group_used_count": "topk_group"},
}
_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
_TOKEN_IDS = {"tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
              "tokenizer.ggml.padding_token_id": "pad_token_id"}


def gguf_model_type(arch: str, meta: dict) -> str:
    """The transformers model_type of a GGUF architecture; one-line TiermoeError when tiermoe cannot run it."""
    model_type = GGUF_ARCHS.get(arch)
    if arch == "llama" and not meta.get("llama.expert_count"):
        model_type = None
    if model_type is None:
        supported = ", ".join(sorted(set(GGUF_ARCHS) - {"llama"})) + ", llama with experts (Mixtral)"
        kind = "a dense model" if arch in ("llama", "qwen2", "qwen3", "mistral", "gemma3") else "not supported"
        raise TiermoeError(f"GGUF architecture '{arch}' is {kind}; tiermoe reads GGUF MoE models of: {supported}")
    return model_type


def config_fields_from_gguf(meta: dict, tensor_names: set[str]) -> dict:
    """Config fields (with `model_type`) from GGUF metadata `meta` (scalars by key) and the tensor names."""
    arch = meta.get("general.architecture")
    if not arch:
        raise TiermoeError("GGUF file has no general.architecture; is it a model file?")
    model_type = gguf_model_type(arch, meta)
    if arch == "deepseek2" and meta.get("deepseek2.expert_gating_func", 1) != _SIGMOID_GATING:
        model_type = "deepseek_v2"
    fields: dict = {"model_type": model_type}
    family = "deepseek" if arch == "deepseek2" else model_type
    for key, field in {**_COMMON, **_PER_ARCH[family]}.items():
        if f"{arch}.{key}" in meta:
            fields[field] = meta[f"{arch}.{key}"]
    for key, field in _TOKEN_IDS.items():
        if key in meta:
            fields[field] = meta[key]
    missing = [f for f in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_experts_per_tok")
               if f not in fields]
    if missing:
        raise TiermoeError(f"GGUF metadata of '{arch}' lacks {', '.join(missing)}; the file is incomplete")
    fields["vocab_size"] = meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens_count") or meta.get(
        "_token_embd_rows")
    layers = fields["num_hidden_layers"]
    moe = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names]
    if not moe:
        raise TiermoeError(f"GGUF '{arch}' file has no expert router tensors (blk.N.ffn_gate_inp); not a MoE model")
    if model_type == "qwen3_moe":
        fields.update(norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(layers) if i not in moe])
    elif model_type == "qwen2_moe":
        fields.update(norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(layers) if i not in moe])
    elif family == "deepseek":
        _deepseek_fields(arch, meta, fields, moe, layers)
    elif len(moe) != layers:
        raise TiermoeError(f"GGUF '{arch}' file has experts in {len(moe)} of {layers} layers; Mixtral has them in all")
    fields["tie_word_embeddings"] = "output.weight" not in tensor_names
    fields = _rope_fields(arch, meta, fields)
    return fields


def _deepseek_fields(arch: str, meta: dict, fields: dict, moe: list[int], layers: int) -> None:
    """MLA head sizes (llama.cpp's newer files split kv_b and keep the per-head sizes under *_mla keys), MQA
    head counts back to transformers' per-head ones, and the dense-first layer rule checked against the tensors."""
    rope = fields.get("qk_rope_head_dim", 0)
    key = meta.get(f"{arch}.attention.key_length_mla") or meta.get(f"{arch}.attention.key_length")
    value = meta.get(f"{arch}.attention.value_length_mla") or meta.get(f"{arch}.attention.value_length")
    if key is None or value is None:
        raise TiermoeError(f"GGUF '{arch}' metadata lacks attention.key_length / value_length")
    fields.update(qk_nope_head_dim=key - rope, v_head_dim=value,
                  num_key_value_heads=fields["num_attention_heads"])
    if not fields.get("q_lora_rank"):
        fields["q_lora_rank"] = None  # DeepSeek-V2-Lite projects q directly
    first = fields.get("first_k_dense_replace", 0)
    if moe != list(range(first, layers)):
        raise TiermoeError(f"GGUF '{arch}' file has experts in layers {moe}, expected {first}..{layers - 1}")
    if fields["model_type"] == "deepseek_v2":
        fields["topk_method"] = "group_limited_greedy" if fields.get("n_group", 1) > 1 else "greedy"


def _rope_fields(arch: str, meta: dict, fields: dict) -> dict:
    """rope_theta (and YaRN scaling, as DeepSeek-V3 uses it) as transformers 5's rope_parameters."""
    if "rope_theta" not in fields:
        return fields
    params = {"rope_type": "default", "rope_theta": float(fields.pop("rope_theta"))}
    if meta.get(f"{arch}.rope.scaling.type") == "yarn":
        params.update(rope_type="yarn", factor=float(meta[f"{arch}.rope.scaling.factor"]),
                      original_max_position_embeddings=int(meta[f"{arch}.rope.scaling.original_context_length"]))
        multiplier = meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")
        if multiplier:  # llama.cpp stores 0.1 * mscale_all_dim, as float32: round its noise away (1.0, not 1.00000001)
            mscale = round(float(multiplier) / 0.1, 6)
            params.update(mscale=mscale, mscale_all_dim=mscale)
    fields["rope_parameters"] = params
    return fields
