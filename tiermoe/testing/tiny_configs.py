"""Any architecture's default config, shrunk to a tiny one by rules on its field names (no per-architecture table).

transformers ships a default config for every model type, sized like a real release. A test of every MoE
architecture needs each at toy sizes with every structural feature kept: its layer kinds (the shortest prefix of
its per-layer lists that shows every kind, at most MAX_LAYERS layers), dense layers before MoE ones, shared
experts, groups. Each integer field is matched by name against SIZE_RULES (first match wins) and takes the tiny
value, or is a layer index clamped into the kept layers, or is one of NOT_SIZES; an integer field above
UNRECOGNISED_ABOVE that no rule names raises, so a new architecture's new size field is seen, not kept at its
real size. Expert fields the default leaves None (a family whose default is dense: Gemma-4) get the tiny value
and MoE switches (`enable_moe_block`) are turned on, so the MoE path is what is built.
"""

from __future__ import annotations

import itertools
import re

from transformers import AutoConfig

from tiermoe.arch.unset_fields import with_moe_path
from tiermoe.errors import TiermoeError

MAX_LAYERS = 6
UNRECOGNISED_ABOVE = 64
HIDDEN = 64
HEAD_DIM = 16
# Head dims (query, key, rope, value, MLA's nope and rope parts, linear-attention and indexer heads) are divided by
# one power of two, so every sum and equality among them holds (MLA: qk_head_dim = nope + rope).
HEAD_DIMS = re.compile(r"head_dim$|^rotary_dim$|^mamba_d_head$")

# (field name pattern, tiny value): first match wins. Values keep heads divisible by kv heads, experts by groups.
SIZE_RULES: tuple[tuple[str, int], ...] = (
    (r"^(unpadded_|ngram_)?vocab_size(_base|_per_layer_input)?$", 256),
    (r"^hidden_size$", HIDDEN),
    (r"^(router_hidden_size|hidden_size_per_layer_input|ple_embed_dim)$", 16),
    (r"intermediate_size|^(expert_)?ffn_hidden_size$", 32),
    (r"^(num_experts|n_routed_experts|num_local_experts|moe_num_experts)$", 8),
    (r"^(num_experts_per_tok|num_experts_per_token|moe_topk|moe_k|top_k_experts)$", 2),
    (r"^(zero_expert_num)$", 2),
    (r"^(n_group|num_expert_group)$", 4),
    (r"^topk_group$", 2),
    (r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$", 1),
    (r"^index_(num|n)_heads$", 2),  # at most the query heads of one key head
    (r"^mamba_(n|num)_heads$", 8),  # Mamba-2: heads x head dim (16) = expand (2) x hidden (64)
    (r"^(swa_)?num_key_value_heads$|^linear_num_key_heads$|^(swa_)?num_kv_heads$", 2),
    (r"num_attention_heads|num_heads$|n_heads$|^linear_num_value_heads$", 4),
    (HEAD_DIMS.pattern, HEAD_DIM),  # then scaled together: see _scale_head_dims
    (r"_rank$|^hc_lowrank$", 16),
    (r"^(mamba_d_state|ssm_state_size)$", 8),
    (r"^(sliding_window|sliding_window_size|attention_chunk_size)$", 8),
    (r"chunk_size$|block_size$", 8),
    (r"^index_topk$", 4),
    (r"^index_topk_blocks$|^index_local_blocks$", 2),
    (r"^index_pool_size$", 32),
    (r"^index_num_local_tokens$", 8),
    (r"^(mamba_)?n_groups$|^n_layers_per_", 1),
    (r"^(max_position_embeddings|model_max_length)$", 512),
    (r"_token_id$", 0),  # remapped into the vocabulary below
)
# Integers that are not sizes (seeds, iteration counts, scaling constants, positions a rope was trained on).
NOT_SIZES = frozenset({
    "seed", "floor_scale", "log_scaling_n_floor", "hc_sinkhorn_iters", "rel_extent", "split_ngram_parts",
    "make_ngram_vocab_size_divisible_by", "original_max_position_embeddings", "compress_rates",
    "chunk_size_feed_forward", "pretraining_tp", "num_logits_to_keep", "id2label", "label2id",
})
# Scalars that count the dense layers before the first MoE one, or name a layer: clamped into the kept layers.
_DENSE_PREFIX = re.compile(r"^(first_k_dense_replace|num_dense_layers|num_dense_blocks|moe_layer_start_index)$")
_LAYER_INDEX = re.compile(r"layer.*(index|_end|_start)|^max_window_layers$")
_LAYER_OFFSET = re.compile(r"_layer_offset$")  # Jamba: attention at layer period * k + offset
_LAYER_COUNT = ("num_hidden_layers", "num_layers")
_TIED = (re.compile(r"head_dim$|^rotary_dim$"), re.compile(r"heads$"))
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def tiny_config(model_type: str, **overrides):
    """`model_type`'s default config with every size shrunk (see the module docstring); `overrides` last."""
    default = AutoConfig.for_model(model_type)
    fields = shrink_fields(default.to_dict())
    fields.update(overrides)
    fields.pop("model_type", None)
    fields.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **fields)


def shrink_fields(fields: dict) -> dict:
    """A config's fields (`to_dict()`) with its sizes tiny and its layers cut to the prefix that shows every kind."""
    out = {k: v for k, v in fields.items() if not isinstance(v, dict) or k in ("rope_parameters", "per_layer_config")}
    for key, value in fields.items():
        if isinstance(value, dict) and key not in out:
            out[key] = value if key in NOT_SIZES else shrink_fields(value)  # a sub-config (text_config, ...)
    count_key = next((k for k in _LAYER_COUNT if isinstance(fields.get(k), int)), None)
    if count_key is None:
        out = _shrink_scalars(out, None)
        _scale_head_dims(out, fields)
        return out
    total = fields[count_key]
    layers = kept_layers(fields, total)
    out[count_key] = layers
    for key, value in fields.items():
        if isinstance(value, list) and value and key not in ("architectures",):
            out[key] = _cut_layer_list(key, value, total, layers)
    if isinstance(fields.get("per_layer_config"), dict):
        out["per_layer_config"] = {k: _shrink_scalars(dict(v), layers) for k, v in fields["per_layer_config"].items()
                                   if not k.isdigit() or int(k) < layers}
    if isinstance(fields.get("rope_parameters"), dict):
        out["rope_parameters"] = _shrink_rope(fields["rope_parameters"])
    out = _shrink_scalars(out, layers)
    _scale_head_dims(out, fields)
    return out


def kept_layers(fields: dict, total: int) -> int:
    """The shortest prefix of the layers in which every combination of the per-layer string lists (layer kinds,
    MLP kinds) appears, at least 2 and at most MAX_LAYERS; 2 when the config has no such list."""
    lists = [v for v in fields.values() if isinstance(v, list) and len(v) == total and v and isinstance(v[0], str)]
    offsets = [v + 1 for k, v in fields.items() if _LAYER_OFFSET.search(k) and isinstance(v, int)]
    if not lists:
        return min(total, max(2, min(max(offsets, default=0), MAX_LAYERS)))
    seen, prefix = set(), 0
    for i, kinds in enumerate(zip(*lists)):
        if kinds not in seen:
            seen.add(kinds)
            prefix = i + 1
    return min(total, max(2, min(prefix, MAX_LAYERS)))


def _cut_layer_list(key: str, value: list, total: int, layers: int) -> list:
    """A list field in the kept layers: per-layer values truncated; layer indices (strictly increasing) kept
    where they are inside."""
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    increasing = ints and all(a < b for a, b in itertools.pairwise(value))
    if value == list(range(total)):
        return list(range(layers))  # every layer's index (Llama-4's moe_layers)
    if len(value) == total:
        return [_shrink_value(key, v, layers) for v in value[:layers]]
    if increasing and key.endswith(("layers", "layer_ids")):
        return [v for v in value if v < layers]
    if ints:
        return [_shrink_value(key, v, layers) for v in value]
    return value


def _shrink_rope(params: dict) -> dict:
    """Rope parameters (flat, or one dict per layer kind) as they are: dims come from the (shrunk) head dims."""
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in params.items()}


def _shrink_scalars(fields: dict, layers: int | None) -> dict:
    default = dict(fields)
    filled, changed = with_moe_path(fields, _rule_value)  # expert fields a default leaves None, MoE switches on
    for key, value in default.items():
        if key not in changed and isinstance(value, int) and not isinstance(value, bool):
            filled[key] = _shrink_value(key, value, layers)
    fields.update(filled)
    _keep_ties(fields, default)
    return fields


def _shrink_value(key: str, value, layers: int | None):
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    if key in _TOKEN_IDS or key.endswith("_token_id"):
        return value if value < 256 else _TOKEN_IDS.get(key, 3)
    if layers is not None and _DENSE_PREFIX.match(key):
        return min(value, layers - 1)
    if layers is not None and _LAYER_INDEX.search(key):
        return min(value, max(1, layers // 2) if key.endswith("_start") else layers)
    size = _rule_value(key)
    if size is not None:
        return min(value, size) if value > 0 else value
    if value > UNRECOGNISED_ABOVE and key not in NOT_SIZES:
        raise TiermoeError(f"config field '{key}' = {value} looks like a size no rule of tiermoe.testing.tiny_configs "
                           "names; add a rule (or NOT_SIZES) for it")
    return value


def _rule_value(key: str) -> int | None:
    for pattern, size in SIZE_RULES:
        if re.search(pattern, key):
            return size
    return None


def _keep_ties(fields: dict, default: dict) -> None:
    """Head counts (and head dims) the default gives equal stay equal: a model may require it (MLA's rope head dim
    is its `head_dim`; some attention needs as many key/value heads as query heads)."""
    for family in _TIED:
        keys = [k for k in fields if family.search(k) and isinstance(default.get(k), int)]
        for value in {default[k] for k in keys}:
            tied = [k for k in keys if default[k] == value]
            if len(tied) > 1:
                smallest = min(fields[k] for k in tied)
                for k in tied:
                    fields[k] = smallest


def _scale_head_dims(out: dict, fields: dict) -> None:
    """Every head dim of `fields` (and of its per-layer configs) divided by the largest power of two that divides
    them all and leaves the largest at least HEAD_DIM."""
    scopes = [(out, fields)] + [(out["per_layer_config"][k], v) for k, v in
                                (fields.get("per_layer_config") or {}).items() if k in out.get("per_layer_config", {})]
    found = [(o, k, v) for o, f in scopes for k, v in f.items()
             if HEAD_DIMS.search(k) and isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if not found:
        return
    factor, largest = 1, max(v for _, _, v in found)
    while largest // (factor * 2) >= HEAD_DIM and all(v % (factor * 2) == 0 for _, _, v in found):
        factor *= 2
    for o, k, v in found:
        o[k] = v // factor
