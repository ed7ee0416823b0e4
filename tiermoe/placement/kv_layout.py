"""KV cache bytes by layer kind: what the engine's caches hold for a number of tokens and running sequences.

transformers 5 builds one cache layer per decoder layer from the config's layer_types (as
transformers.cache_utils.get_layer_types_and_kwargs reads them), and tiermoe keeps those layers (measured on the
engine's caches in tests/test_fit_kv_layers.py):
- full attention (DynamicLayer; tiermoe's MLA latent layer): every token of every sequence;
- sliding window (DynamicSlidingWindowLayer, GPT-OSS): the last sliding_window - 1 tokens of each sequence (the
  layer that is running holds its new chunk on top, transiently);
- linear attention (LinearAttentionLayer, Qwen3-Next's gated DeltaNet): per sequence, whatever its length, a conv
  state [conv_dim, linear_conv_kernel_dim] in the compute dtype and a recurrent state [linear_num_value_heads,
  linear_key_head_dim, linear_value_head_dim] in fp32 (the delta rule runs in fp32 whatever the compute dtype),
  twice: the pool keeps two banks per sequence, so a failed step leaves the state it read
  (tiermoe.layers.linear_attention_slots).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermoe.errors import TiermoeError

SLIDING_LAYERS = ("sliding_attention", "chunked_attention")
LINEAR_LAYERS = ("linear_attention",)
NO_CACHE_LAYERS = ("moe", "mlp", "dummy")
RECURRENT_STATE_BYTES = 4  # fp32
LINEAR_STATE_BANKS = 2  # tiermoe.layers.linear_attention_slots.BANKS


@dataclass(frozen=True)
class KVLayout:
    """Cache bytes of one model, by layer kind. Token counts are over all running sequences together."""

    full_per_token: int  # full-attention layers together, per token
    sliding_per_token: int = 0  # sliding-window layers together, per token they keep
    sliding_tokens: int = 0  # tokens a sliding-window layer keeps per sequence (sliding_window - 1)
    linear_state: int = 0  # linear-attention layers together, per sequence

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
        return ", ".join(parts)


def layer_kinds(cfg) -> list[str]:
    """One cache kind per decoder layer: "full", "sliding", "linear" or "none", as transformers chooses them."""
    types = getattr(cfg, "layer_types", None)
    if not types:
        sliding = getattr(cfg, "sliding_window", None) is not None
        types = ["sliding_attention" if sliding else "full_attention"] * cfg.num_hidden_layers
    return ["sliding" if t in SLIDING_LAYERS else "linear" if t in LINEAR_LAYERS else
            "none" if t in NO_CACHE_LAYERS else "full" for t in types]


def attention_bytes_per_token(cfg, dtype_bytes: int) -> int:
    """One attention layer's cache bytes per token: MLA (DeepSeek V2/V3, tiermoe.layers.mla_attention) keeps one
    latent shared by all heads (kv_lora_rank + qk_rope_head_dim); standard attention K and V per KV head."""
    if getattr(cfg, "kv_lora_rank", None):
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim * dtype_bytes


def linear_state_bytes(cfg, dtype_bytes: int) -> int:
    """One linear-attention layer's state per sequence (Qwen3-Next's gated DeltaNet), both banks."""
    try:
        k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        k_dim, v_dim, kernel = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    except AttributeError as err:
        raise TiermoeError(f"linear-attention layers of an unknown kind ({err}); tiermoe counts Qwen3-Next's") from None
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim  # q, k and v go through the causal conv together
    return LINEAR_STATE_BANKS * (conv_dim * kernel * dtype_bytes + v_heads * k_dim * v_dim * RECURRENT_STATE_BYTES)


def kv_layout(cfg, dtype_bytes: int) -> KVLayout:
    """The cache bytes of the text config `cfg` in a compute dtype of `dtype_bytes` bytes."""
    kinds = layer_kinds(cfg)
    per_layer = attention_bytes_per_token(cfg, dtype_bytes)
    sliding = kinds.count("sliding")
    linear = kinds.count("linear")
    return KVLayout(
        full_per_token=kinds.count("full") * per_layer,
        sliding_per_token=sliding * per_layer,
        sliding_tokens=max(0, cfg.sliding_window - 1) if sliding else 0,
        linear_state=linear * linear_state_bytes(cfg, dtype_bytes) if linear else 0,
    )


def kv_cache_bytes(cfg, dtype_bytes: int, tokens: int, sequences: int) -> int:
    """Cache bytes of `sequences` running sequences holding `tokens` tokens in all (see KVLayout.bytes)."""
    return kv_layout(cfg, dtype_bytes).bytes(tokens, sequences)
