"""Attention over the paged KV pool for transformers' own attention modules, one ragged forward per step.

The engine runs every scheduled sequence's new tokens as one [1, T] forward (tiermoe.layers.ragged_step). The
attention modules stay transformers' (their projections, norms and rope); two things are ours:
- the cache they call, `PagedStepCache`: `update` writes the step's new K/V into the pool's slots and returns the
  K/V the step reads (the step's read_pages: the past where it lies, gathered once, plus the new tokens);
- the attention function, registered with transformers as `tiermoe_paged_<original>` and set as the model's
  attention implementation by `use_paged_attention`: given the step (the `tiermoe_step` keyword the engine passes
  to the model, which transformers hands every attention call), it attends the decode rows in padded runs of
  similar lengths and each longer segment alone, each part with its own mask, through the model's original
  attention function
  (sdpa, or eager with GPT-OSS's sinks), so each sequence sees exactly its own keys. Without a step (a plain
  forward with a transformers cache, e.g. from a test) it is the original function with the original masks.
A step whose decode rows attend in place (step.decode_attention, tiermoe.layers.decode_attention) gets the
layer's slots themselves from `update`, no gather: the decode rows read them through their page tables in one
native call, and only the segments' pages are gathered, by the attention function. Where the step's prompt chunks
attend in place too (step.chunk_attention: the Triton kernel, CUDA's, or the native kernel, the CPU's), nothing is
gathered.
Legend: T new tokens, K read keys, H heads, d head dim, b rows of one attention call, q its queries, w its keys.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tiermoe.layers.kv_pages import KVPages
from tiermoe.layers.pool_kinds import check_pool_kinds
from tiermoe.layers.ragged_step import RaggedStep

STEP_KWARG = "tiermoe_step"
LINEAR = "linear"  # the page group of linear-attention layers: no pages, per-sequence state slots
PAGED_PREFIX = "tiermoe_paged_"
_SUPPORTED = ("sdpa", "eager")  # original implementations whose per-part results the tests compare


@dataclass(frozen=True)
class Part:
    """One attention call of a step: query rows [r0, r0 + b * q), keys [k0, k0 + b * w) of the gathered K/V."""

    rows: slice
    keys: slice
    b: int  # rows of the call (a run of decode rows, or 1 for a segment)
    q: int  # queries per row
    w: int  # keys per row
    mask: torch.Tensor  # [b, 1, q, w] additive


def parts(step: RaggedStep, window: int | None) -> Iterator[Part]:
    """Each gathered attention call of the step (step.row_parts from step.first_gathered), with its keys in this
    page group."""
    size = step.page_size
    for part, keys in zip(step.row_parts[step.first_gathered:], step.groups[window].parts):
        w = (keys.end - keys.first) * size // part.b
        yield Part(part.rows, slice(keys.first * size, keys.end * size), part.b, part.q, w, keys.mask)


def part_queries(x_1HTd: torch.Tensor, part: Part) -> torch.Tensor:
    """[1, H, T, d] -> this part's [b, H, q, d] (a view)."""
    return x_1HTd[0, :, part.rows].unflatten(1, (part.b, part.q)).transpose(0, 1)


def part_keys(x_1HKd: torch.Tensor, part: Part) -> torch.Tensor:
    """[1, H, K, d] -> this part's [b, H, w, d] (a view)."""
    return x_1HKd[0, :, part.keys].unflatten(1, (part.b, part.w)).transpose(0, 1)


def attend_parts(step: RaggedStep, window: int | None, out_1THd: torch.Tensor,
                 attend: Callable[[Part], torch.Tensor]) -> torch.Tensor:
    """Fill out [1, T, H, d] with `attend(part)` ([b, q, H, d]) for every part of the step."""
    for part in parts(step, window):
        out_1THd[0, part.rows] = attend(part).reshape(part.b * part.q, *out_1THd.shape[2:])
    return out_1THd


class PagedStepCache(Cache):
    """What transformers' attention modules call `update` on during a step: the pool, through the step's
    indices. Linear-attention layers are not served here (see tiermoe.layers.linear_attention_slots)."""

    def __init__(self, pages: KVPages, step: RaggedStep, linear=None):
        self.pages, self.step = pages, step
        self.linear = linear  # the linear-attention state slots (tiermoe.layers.linear_attention_slots), if any
        self.layers = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """New K/V [1, H, T, d] -> the K/V the step reads [1, H, K, d] (new ones included; K = pages read x P)."""
        k_slots, v_slots = self.write(layer_idx, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        if self.step.decode_attention is not None or self.step.chunk_attention is not None:
            return k_slots, v_slots  # the attention function reads the slots where they lie
        pages = self.step.groups[self.step.layer_windows[layer_idx]].read_pages
        return gather_pages(k_slots, pages, self.step.page_size), gather_pages(v_slots, pages, self.step.page_size)

    def write(self, layer_idx: int, k_THd: torch.Tensor, v_THd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's new K/V [T, H, d] into their pool slots; returns the layer's K and V slots [S, H, d]."""
        window = self.step.layer_windows[layer_idx]
        write_index = self.step.groups[window].write_index
        k_slots, v_slots = self.pages.slots(layer_idx, window, k_THd, v_THd)
        k_slots.index_copy_(0, write_index, k_THd)
        v_slots.index_copy_(0, write_index, v_THd)
        return k_slots, v_slots



def gather_pages(slots_SHd: torch.Tensor, pages_N: torch.Tensor, page_size: int) -> torch.Tensor:
    """Whole pages gathered: [S, H, d] slots -> [1, H, N * P, d]. Each page as one flat row: index_select copies
    rows of a 2-D tensor several times faster than of a 4-D one (3.4x measured for 4 KB pages in bf16)."""
    rows = slots_SHd.view(slots_SHd.shape[0] // page_size, -1)  # [pages, P * H * d]
    return rows.index_select(0, pages_N).view(-1, *slots_SHd.shape[1:]).transpose(0, 1)[None]


def layer_windows(config) -> dict[int, int | None | str]:
    """Per decoder layer: None (full attention), its sliding window, or LINEAR, as transformers' DynamicCache
    lays the model's cache out (so the pool keeps exactly what transformers' caches keep)."""
    windows = {}
    for i, layer in enumerate(DynamicCache(config=config).layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            windows[i] = LINEAR
        else:
            windows[i] = getattr(layer, "sliding_window", None)
    return windows


def use_paged_attention(model) -> str:
    """Make `model`'s attention modules attend through the pool when given a step (and as before otherwise);
    returns the original implementation's name. Raises ValueError for an implementation not checked here."""
    check_pool_kinds(model)  # a layer kind the pool does not know is refused, by name, not served wrongly
    original = model.config._attn_implementation
    if original.startswith(PAGED_PREFIX):
        return original[len(PAGED_PREFIX):]
    if original not in _SUPPORTED:
        raise ValueError(f"attention implementation {original!r} is not supported by the KV pool "
                         f"(supported: {', '.join(_SUPPORTED)})")
    name = PAGED_PREFIX + original
    ALL_ATTENTION_FUNCTIONS.register(name, paged_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    model.config._attn_implementation = name
    for module in model.modules():  # sub-configs (e.g. a text config) name the implementation too
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == original:
            config._attn_implementation = name
    return original


def original_attention(module) -> Callable:
    """The attention function `module` would call without the pool: the model file's own eager function (GPT-OSS's
    has sinks) or transformers' registered one."""
    name = module.config._attn_implementation.removeprefix(PAGED_PREFIX)
    if name == "eager":  # the module's own class, or that of the transformers module it took the place of
        return sys.modules[getattr(module, "original_class", type(module)).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, H, T, d], key/value [1, Hkv, K, d] as the pool's
    cache returned them (or, when the decode rows attend in place, the layer's slots [S, Hkv, d] themselves)
    -> ([1, T, H, dv], None)."""
    step = kwargs.pop(STEP_KWARG, None)
    attend = original_attention(module)
    if step is None:
        return attend(module, query, key, value, attention_mask, **kwargs)
    window = step.layer_windows[module.layer_idx]
    out = query.new_empty((1, query.shape[2], query.shape[1], value.shape[-1]))
    scale = query.shape[-1] ** -0.5 if kwargs.get("scaling") is None else kwargs["scaling"]
    if step.chunk_attention is not None:  # every row in place: no part is left to gather
        step.attend_in_place(window, query[0].transpose(0, 1), key, value, scale, kwargs.get("s_aux"), out[0])
    elif step.decode_attention is not None:
        key, value = _decode_in_place(step, window, query, key, value, out, scale, kwargs.get("s_aux"))

    def one_part(part: Part) -> torch.Tensor:
        result, _ = attend(module, part_queries(query, part), part_keys(key, part), part_keys(value, part),
                           part.mask, **kwargs)
        return result

    return attend_parts(step, window, out, one_part), None


def _decode_in_place(step: RaggedStep, window: int | None, query: torch.Tensor, k_SHd: torch.Tensor,
                     v_SHd: torch.Tensor, out_1THd: torch.Tensor, scale: float,
                     sinks_H: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' attention, read from the slots [S, Hkv, d] in place, into out's first rows; returns the
    segments' gathered K/V [1, Hkv, K, d] (what the parts read)."""
    n = step.num_decode
    step.attend_decode_rows(window, query[0, :, :n].transpose(0, 1), k_SHd, v_SHd, scale, sinks_H, out_1THd[0, :n])
    return segment_keys(step, window, k_SHd, v_SHd)


def segment_keys(step: RaggedStep, window: int | None, k_SHd: torch.Tensor,
                 v_SHd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """After the decode rows attended in place: the K/V slots [S, Hkv, *] gathered into what the step's segments
    read ([1, Hkv, K, *], whole pages), or the slots as they are when the step has no segment."""
    if step.first_gathered == len(step.row_parts):  # decode rows only: nothing to gather
        return k_SHd, v_SHd
    pages = step.groups[window].read_pages
    return gather_pages(k_SHd, pages, step.page_size), gather_pages(v_SHd, pages, step.page_size)
