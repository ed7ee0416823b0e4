"""Batched decode: one model forward for every sequence that feeds one token this step.

Each sequence keeps its own transformers DynamicCache: prefill chunks, the per-sequence fallback and the follower
ranks use it unchanged, and a finished sequence frees it by dropping it. For a decode step, StackedDecodeCache
presents B of those caches to the model as one batch. At every attention layer it appends each row's new K/V to
that row's own cache and hands attention the rows stacked and left-padded to the longest, [B, H, Lmax + 1, d].
Left padding keeps each row's newest key in the last column, where the (single) query sits, so every key keeps
its distance to the query; the 2D attention mask hides the pads and explicit position_ids give each row its own
rotary position. The stack is built one layer at a time and dropped after it, so KV memory stays what the
per-sequence caches hold (bounded by --max-total-tokens) plus one layer's padded copy; `decode_groups` keeps
that copy within 1.5 times the real positions (beyond a small allowance) by splitting rows of very different
lengths into several batches.

Exact only where every cache layer is a plain DynamicLayer (full attention over all past tokens): sliding-window
layers (GPT-OSS) trim their caches and linear-attention layers (Qwen3-Next) keep recurrent states, so such
models keep the per-sequence path. `supports_batched_decode` decides once per model.

Legend: B rows (sequences), H heads, L key positions, d head dim, V vocabulary.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

# Attention implementations whose padded result the tests compare with per-sequence forwards.
_CHECKED_ATTENTION = ("sdpa", "eager")
# Pad positions a batch may always carry: on short contexts one batch is cheaper than splitting it, and this many
# positions of one layer's K/V are a few MB even for large models.
PAD_ALLOWANCE = 4096


def supports_batched_decode(model) -> bool:
    """Whether a padded batch of per-sequence caches gives `model` each sequence's own attention.

    The model builds `DynamicCache(config=model.config)` when it gets no cache; batching is exact when every layer
    of that cache is a plain DynamicLayer (no sliding window, no linear-attention state, no shared KV).
    """
    if getattr(model.config, "_attn_implementation", None) not in _CHECKED_ATTENTION:
        return False
    layers = DynamicCache(config=model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def can_join(cache) -> bool:
    """A sequence's cache can be a row of a StackedDecodeCache (it exists and is a plain DynamicCache)."""
    return type(cache) is DynamicCache and bool(cache.layers) and all(
        type(layer) is DynamicLayer and layer.is_initialized for layer in cache.layers)


def decode_groups(past: list[int], pad_allowance: int = PAD_ALLOWANCE) -> list[list[int]]:
    """Split rows with past lengths `past` into batches whose padding (pad positions of the stacked [B, Lmax + 1])
    stays within max(half the real positions, pad_allowance). Longest first; batches of one row are left out (a
    row alone needs no padding: it runs the plain per-sequence forward). Returns lists of indices into `past`."""
    order = sorted(range(len(past)), key=lambda i: (-past[i], i))
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is not None:
            width = past[group[0]] + 1  # the group's first row is its longest
            real = sum(past[j] + 1 for j in group) + past[i] + 1
            if (len(group) + 1) * width - real <= max(real // 2, pad_allowance):
                group.append(i)
                continue
        groups.append([i])
    return [g for g in groups if len(g) >= 2]


def left_pad_stack(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows [1, H, L_b, d] -> [B, H, max L_b, d], each row right-aligned (zeros before it)."""
    longest = max(t.shape[-2] for t in rows)
    if all(t.shape[-2] == longest for t in rows):
        return torch.cat(rows)
    first = rows[0]
    out = first.new_zeros((len(rows), *first.shape[1:-2], longest, first.shape[-1]))
    for b, t in enumerate(rows):
        out[b, ..., longest - t.shape[-2]:, :] = t[0]
    return out


class _StackedLayer(CacheLayerMixin):
    """One layer of B per-sequence DynamicLayers, seen as a left-padded batch."""

    is_sliding = False

    def __init__(self, rows: list[DynamicLayer], max_past: int):
        super().__init__()
        self.rows = rows
        self.max_past = max_past
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the rows are initialised (can_join)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """New K/V [B, H, 1, d]: row b goes into sequence b's own cache; returns the padded stacks."""
        keys, values = [], []
        for b, row in enumerate(self.rows):
            k, v = row.update(key_states[b:b + 1], value_states[b:b + 1])
            keys.append(k)
            values.append(v)
        return left_pad_stack(keys), left_pad_stack(values)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_past + query_length, 0

    def get_seq_length(self) -> int:
        return self.max_past

    def get_max_length(self) -> int:
        return -1


class StackedDecodeCache(Cache):
    """B sequences' DynamicCaches as one cache, for one forward that feeds one token per sequence."""

    def __init__(self, caches: list[DynamicCache]):
        self.past_B = [c.get_seq_length() for c in caches]
        max_past = max(self.past_B)
        num_layers = len(caches[0].layers)
        if any(len(c.layers) != num_layers for c in caches):
            raise ValueError("the sequences' caches have different numbers of layers")
        super().__init__(layers=[_StackedLayer([c.layers[i] for c in caches], max_past) for i in range(num_layers)])

    def model_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask [B, Lmax + 1] with 0 on the pads, position_ids [B, 1] = each row's own position)."""
        past_B = torch.tensor(self.past_B, dtype=torch.long)
        max_past = int(past_B.max())
        first_real_B = max_past - past_B  # left pads of each row
        mask_BL = (torch.arange(max_past + 1)[None, :] >= first_real_B[:, None]).long()
        return mask_BL.to(device), past_B[:, None].to(device)


def batched_decode_forward(model, caches: list[DynamicCache], tokens: list[int], device: torch.device,
                           cache_kwarg: str) -> list[torch.Tensor]:
    """One forward feeding tokens[b] to the sequence of caches[b]; appends to each cache, returns each row's
    logits [V] (in order)."""
    stacked = StackedDecodeCache(caches)
    attention_mask_BL, position_ids_B1 = stacked.model_inputs(device)
    ids_B1 = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
    out = model(input_ids=ids_B1, attention_mask=attention_mask_BL, position_ids=position_ids_B1, use_cache=True,
                logits_to_keep=1, **{cache_kwarg: stacked})
    return list(out.logits[:, -1])  # [B, V] -> B x [V]
