"""The attention and state kinds the engine's KV pool holds, and one clear refusal for the others.

A layer kind is what tiermoe.arch.discover.layer_kinds reads from transformers: the cache layer type it gives the
config, with the class of a linear-attention (state) module. The pool holds K/V pages for full and sliding-window
attention (sinks and MLA included: transformers' MLA modules hand the cache whole keys and values), layers without
attention, and per-sequence state slots for the linear-attention modules whose multi-token forward continues from
the state it is handed (tiermoe.arch.layer_caches.CONTINUING_STATE_MODULES: the gated DeltaNets, Bailing's and
Kimi's delta attention, Nemotron-H's Mamba-2; tiermoe.layers.linear_attention_slots). Any other kind (Jamba's
Mamba or MiniMax's lightning state, sparse-indexer, chunked or compressed attention, a layer that is both, K/V
shared between layers) would be served wrongly by a pool that does not know it, so an engine over such a model is
refused, naming the kind; the model itself still runs with transformers' own caches. Each kind the pool learns is
its own change here.
"""

from __future__ import annotations

from torch import nn

from tiermoe.arch.discover import layer_kinds
from tiermoe.arch.layer_caches import CONTINUING_STATE_MODULES

PAGED = ("full_attention", "sliding_attention", "dummy")  # "dummy": no attention in the layer


def pool_lacks(kind: str) -> bool:
    """Whether the KV pool cannot hold layers of `kind` (a layer_kinds entry)."""
    base = kind.split("+")[0]
    cache, _, module = base.partition(":")
    if cache in PAGED:
        return False
    return not (cache == "linear_attention" and module.endswith(CONTINUING_STATE_MODULES))


def check_pool_kinds(model: nn.Module) -> None:
    """Raise ValueError (one line) when a decoder layer of `model` has a kind the pool lacks."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return
    kinds = layer_kinds(model.config, layers)
    lacking = {}
    for i, kind in enumerate(kinds):
        if pool_lacks(kind):
            lacking.setdefault(kind.split("+")[0], []).append(i)
    if lacking:
        named = "; ".join(f"{kind} (layers {', '.join(map(str, idx[:6]))}{', ...' if len(idx) > 6 else ''})"
                          for kind, idx in lacking.items())
        raise ValueError(f"{model.config.model_type}: the KV pool does not hold {named} yet, so the engine cannot "
                         "serve this model (it runs with transformers' caches: hybrid(input_ids=...))")
