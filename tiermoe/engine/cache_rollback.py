"""Putting a sequence's KV cache back where it was before a step that failed part-way.

A failed forward may already have appended the step's keys and values to some layers of a sequence's cache (the
per-sequence caches grow in place, layer by layer, in a batched decode as in a prefill chunk; the MoE batcher
stops the other forwards of the step at their next MoE block). Before each step the engine marks every
scheduled sequence's cache: the cache object and its length, no copy. After a failure it rolls each back: a
cache the step created is dropped (the sequence had none), and a plain DynamicCache (full attention) is cut, layer
by layer, to the marked length. Other caches (sliding windows that may have dropped old positions, linear-attention
states updated in place) cannot be rolled back: the engine then ends that sequence with the step's error.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import DynamicCache, DynamicLayer


@dataclass(frozen=True)
class CacheMark:
    cache: object | None  # the sequence's cache object before the step (None: the step's forward creates it)
    length: int | None  # its length then; None when it cannot be cut back (not a plain DynamicCache)


def mark(cache) -> CacheMark:
    return CacheMark(cache, cache.get_seq_length() if _can_cut(cache) else None)


def roll_back(seq, cache_mark: CacheMark) -> bool:
    """Give `seq` its cache as marked; False when that cannot be done (the cache was changed in place for good)."""
    seq.cache = cache_mark.cache
    if cache_mark.cache is None:
        return True
    if cache_mark.length is None:
        return False
    for layer in cache_mark.cache.layers:
        if layer.get_seq_length() > cache_mark.length:
            layer.keys = layer.keys[..., :cache_mark.length, :]
            layer.values = layer.values[..., :cache_mark.length, :]
    return True


def _can_cut(cache) -> bool:
    return type(cache) is DynamicCache and all(
        type(layer) is DynamicLayer and layer.is_initialized for layer in cache.layers)
