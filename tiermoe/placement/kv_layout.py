"""KV cache bytes by layer kind: what the engine's caches hold for a number of tokens and running sequences.

Each decoder layer's kind and cache width are read from the model's own modules on the meta device
(tiermoe.arch.discover: the cache layer type transformers gives the config, the K and V projections' widths), and
tiermoe keeps those layers (measured on the engine's caches in tests/test_fit_kv_layers.py and, for every MoE
architecture of the installed transformers, in the zoo):
- full attention (DynamicLayer; tiermoe's MLA latent layer): every token of every sequence;
- sliding window (DynamicSlidingWindowLayer, GPT-OSS): the last sliding_window - 1 tokens of each sequence (the
  layer that is running holds its new chunk on top, transiently);
- linear attention (LinearAttentionLayer: Qwen3-Next's gated DeltaNet and the other modules the pool holds,
  tiermoe.arch.layer_caches.CONTINUING_STATE_MODULES): per sequence, whatever its length, a conv state in the
  compute dtype and a recurrent state, in fp32 where the module keeps it so (the delta rule runs in fp32 whatever
  the compute dtype), their shapes what the module hands its cache (tiermoe.arch.layer_caches.linear_states),
  twice: the pool keeps two banks per sequence, so a failed step leaves the state it read
  (tiermoe.layers.linear_attention_slots).
Layers of a kind the engine's pool does not hold (tiermoe.layers.pool_kinds: the engine refuses such a model) are
not counted; KVLayout.uncounted names them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermoe.arch import text_config
from tiermoe.arch.discover import Discovery, discover
from tiermoe.arch.layer_caches import CONTINUING_STATE_MODULES
from tiermoe.errors import TiermoeError

FULL_LAYERS = ("full_attention",)
SLIDING_LAYERS = ("sliding_attention",)
LINEAR_LAYERS = ("linear_attention",)
NO_CACHE_LAYERS = ("dummy",)
LINEAR_STATE_BANKS = 2  # tiermoe.layers.linear_attention_slots.BANKS


@dataclass(frozen=True)
class KVLayout:
    """Cache bytes of one model, by layer kind. Token counts are over all running sequences together."""

    full_per_token: int  # full-attention layers together, per token
    sliding_per_token: int = 0  # sliding-window layers together, per token they keep
    sliding_tokens: int = 0  # tokens a sliding-window layer keeps per sequence (sliding_window - 1)
    linear_state: int = 0  # linear-attention layers together, per sequence
    uncounted: tuple[str, ...] = ()  # layer kinds the engine's pool does not hold: not counted

    def full_bytes(self, tokens: int) -> int:
        return tokens * self.full_per_token

    def sliding_bytes(self, tokens: int, sequences: int) -> int:
        """At most the window of each sequence: exact when every sequence is past its window, an upper bound
        otherwise (the tokens may lie in fewer sequences)."""
        return self.sliding_per_token * min(tokens, sequences * self.sliding_tokens)

    def linear_bytes(self, sequences: int) -> int:
        return sequences * self.linear_state

    def bytes(self, tokens: int, sequences: int) -> int:
        """All cache bytes of `sequences` running sequences holding `tokens` tokens in all."""
        return self.full_bytes(tokens) + self.sliding_bytes(tokens, sequences) + self.linear_bytes(sequences)

    def describe(self, tokens: int, sequences: int) -> str:
        parts = [f"full layers {tokens} tokens x {self.full_per_token} B"]
        if self.sliding_per_token:
            held = min(tokens, sequences * self.sliding_tokens)
            parts.append(f"sliding-window layers {held} tokens ({sequences} sequences x at most "
                         f"{self.sliding_tokens}) x {self.sliding_per_token} B")
        if self.linear_state:
            parts.append(f"linear-attention state {sequences} sequences x {self.linear_state} B")
        if self.uncounted:
            parts.append(f"not counted: {', '.join(self.uncounted)} (a kind the engine's KV pool does not hold)")
        return ", ".join(parts)


def layer_kinds(found: Discovery) -> list[str]:
    """One cache kind per decoder layer: "full", "sliding", "linear", "none", or the discovered kind
    (tiermoe.arch.discover.layer_kinds) where the engine's pool does not hold it."""
    kinds = []
    for kind in found.layer_kinds:
        cache, _, module = kind.split("+")[0].partition(":")
        if cache in FULL_LAYERS or cache in SLIDING_LAYERS:
            kinds.append("full" if cache in FULL_LAYERS else "sliding")
        elif cache in LINEAR_LAYERS and module.endswith(CONTINUING_STATE_MODULES):
            kinds.append("linear")
        else:
            kinds.append("none" if cache in NO_CACHE_LAYERS else kind.split("+")[0])
    return kinds


def attention_bytes_per_token(found: Discovery, cfg, dtype_bytes: int, layer: int) -> int:
    """Attention layer `layer`'s cache bytes per token (a layer with several attention modules, LongCat-Flash's,
    counts them all): K and V widths as its modules are built (MLA, DeepSeek V2/V3 and the families that share it:
    the latent shared by all heads and the roped key, kv_lora_rank + qk_rope_head_dim, as tiermoe caches it), else
    from the layer's config (key/value heads x head dim, K and V)."""
    widths = found.kv_widths[layer] if layer < len(found.kv_widths) else (None,)
    return sum((w if w is not None else _config_width(cfg, layer)) * dtype_bytes for w in widths)


def _layer_config(cfg, layer: int):
    """`layer`'s view of the config (its own values where the config is heterogeneous, Gemma-4's head dims)."""
    return cfg.per_layer_config[layer] if getattr(cfg, "per_layer_config", None) is not None else cfg


def _config_width(cfg, layer: int) -> int:
    per_layer = _layer_config(cfg, layer)
    heads = getattr(per_layer, "num_attention_heads", None)
    head_dim = getattr(per_layer, "head_dim", None) or per_layer.hidden_size // heads
    return 2 * (getattr(per_layer, "num_key_value_heads", None) or heads) * head_dim


def linear_state_bytes(found: Discovery, kinds: list[str], dtype_bytes: int) -> int:
    """The linear-attention layers' states per sequence, together, both banks."""
    sizes = [found.linear_states[i] for i, kind in enumerate(kinds) if kind == "linear"]
    if any(size is None for size in sizes):
        raise TiermoeError("tiermoe cannot read the state this model's linear-attention layers keep")
    return LINEAR_STATE_BANKS * sum(size.nbytes(dtype_bytes) for size in sizes)


def kv_layout(cfg, dtype_bytes: int) -> KVLayout:
    """The cache bytes of `cfg`'s language model (its nested text config where it has one) in a compute dtype of
    `dtype_bytes` bytes."""
    cfg = text_config(cfg)
    found = discover(cfg)
    kinds = layer_kinds(found)
    per_layer = [attention_bytes_per_token(found, cfg, dtype_bytes, i) if k in ("full", "sliding") else 0
                 for i, k in enumerate(kinds)]
    sliding = [i for i, k in enumerate(kinds) if k == "sliding"]
    windows = [getattr(_layer_config(cfg, i), "sliding_window", None) or cfg.sliding_window for i in sliding]
    return KVLayout(
        full_per_token=sum(b for b, k in zip(per_layer, kinds) if k == "full"),
        sliding_per_token=sum(per_layer[i] for i in sliding),
        sliding_tokens=max(0, max(windows) - 1) if sliding else 0,
        linear_state=linear_state_bytes(found, kinds, dtype_bytes) if "linear" in kinds else 0,
        uncounted=tuple(dict.fromkeys(k for k in kinds if k not in ("full", "sliding", "linear", "none"))),
    )


def kv_cache_bytes(cfg, dtype_bytes: int, tokens: int, sequences: int) -> int:
    """Cache bytes of `sequences` running sequences holding `tokens` tokens in all (see KVLayout.bytes)."""
    return kv_layout(cfg, dtype_bytes).bytes(tokens, sequences)
