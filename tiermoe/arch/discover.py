"""Architecture discovery: what a MoE model is, read from transformers' own modules built on the meta device.

transformers 5 gives every MoE block the same parts: a router module, a fused experts module that takes
`(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])` (the `ExpertsInterface`, whose decorator records the
layout: gated or not, biases, transposed, gate and up interleaved) and optionally shared experts. So the skeleton
itself (no weight allocated) says which layers are MoE, where the block sits, how many experts of which shape it
holds, how they compute (`_apply_gate`, `act_fn`) and what each layer attends with (the cache layer types
transformers gives the config). Routing and the block's arithmetic stay the model's own code at run time; only
what a spec needs is read here; how the experts compute, and how their block calls them, is read by
tiermoe.arch.experts_form. Legend: E experts, H hidden, I expert intermediate size, K top-k.
transformers' modules are imported by the functions that build or read them (their import takes seconds, and
tiermoe.arch is imported by commands that never build a model).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from tiermoe.arch.experts_form import ExpertsForm, experts_form, fused_weight
from tiermoe.arch.layer_caches import MIXER_NAMES, StateSize, kv_widths, linear_states
from tiermoe.errors import TiermoeError

# Config fields that give the routed experts per token, in the order families name them.
_TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts", "moe_top_k")
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_topk")
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class Discovery:
    """A model's MoE structure as its modules show it."""

    model_class: str
    num_layers: int
    moe_layers: tuple[int, ...]
    moe_path: str  # the MoE block's path in a decoder layer ("" = the layer itself, as Gemma-4's)
    block_class: str
    router_attr: str
    router_class: str
    shared: tuple[str, ...]  # the block's other children: shared experts, their gate, norms
    shared_intermediate_size: int
    experts: ExpertsForm
    top_k: int
    layer_kinds: tuple[str, ...]  # per decoder layer: see layer_kinds
    kv_widths: tuple[tuple[int | None, ...], ...] = ()  # per decoder layer: tiermoe.arch.layer_caches.kv_widths
    linear_states: tuple[StateSize | None, ...] = ()  # per decoder layer: tiermoe.arch.layer_caches.linear_states
    module_classes: tuple[tuple[str, str], ...] = ()  # (module, qualified name) of every class the model is made of
    block_key: tuple[str, str] = ("", "")  # (module, qualified name) of the MoE block's class

    @property
    def shared_kind(self) -> str:
        """tiermoe.arch.spec.SHARED_KINDS, from the children's names."""
        if "shared_expert_gate" in self.shared:
            return "gated"
        return "plain" if any(name.startswith("shared") for name in self.shared) else "none"


def discover(cfg) -> Discovery:
    """What the modules of `cfg`'s model say (cached per config: building even a meta skeleton of a large model
    takes a second, and every command asks)."""
    key = (type(cfg), cfg.to_json_string(use_diff=False))
    found = _CACHE.get(key)
    if found is None:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        found = _CACHE[key] = _discover(cfg)
    return found


_CACHE: dict[tuple, Discovery] = {}
_CACHE_SIZE = 64


def _discover(cfg) -> Discovery:
    model_type = cfg.model_type
    for name in _EXPERT_COUNT_FIELDS:  # a count below 1 builds a dense model: say what is wrong instead
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise TiermoeError(f"the model's config gives num_experts ({name}) = {value}; expected an integer >= 1")
    model = meta_skeleton(cfg)
    layers = _decoder_layers(model, model_type)
    found = {i: _moe_block(layer) for i, layer in enumerate(layers)}
    moe = {i: f for i, f in found.items() if f is not None}
    if not moe:
        raise TiermoeError(f"this {model_type} config builds no MoE layer (a dense model): no decoder layer has a "
                           "fused experts module")
    first = min(moe)
    path, block = moe[first]
    if any(p != path for p, _ in moe.values()):
        raise TiermoeError(f"{model_type} puts its MoE blocks at different places in different layers "
                           f"({sorted({p for p, _ in moe.values()})}); tiermoe expects one place")
    router_attr, router = _router(block, model_type)
    kinds = layer_kinds(cfg, layers)
    shared = tuple(name for name, _ in block.named_children() if name not in ("experts", router_attr))
    return Discovery(
        model_class=type(model).__name__, num_layers=len(layers), moe_layers=tuple(sorted(moe)), moe_path=path,
        block_class=type(block).__name__, router_attr=router_attr, router_class=type(router).__name__,
        shared=shared, shared_intermediate_size=_shared_intermediate(block),
        experts=experts_form(block.experts, model_type), top_k=_top_k(cfg, block, router, model_type),
        layer_kinds=kinds, kv_widths=kv_widths(layers),
        linear_states=linear_states(layers, kinds, cfg.get_text_config(decoder=True).hidden_size),
        module_classes=tuple(sorted({(type(m).__module__, type(m).__qualname__) for m in model.modules()})),
        block_key=(type(block).__module__, type(block).__qualname__))


def meta_skeleton(cfg) -> nn.Module:
    """transformers' causal LM for `cfg` with every parameter on the meta device (a copy of cfg is used)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, IndexError) as err:
        raise TiermoeError(f"transformers cannot build a {cfg.model_type} model from this config "
                           f"({type(err).__name__}: {err})") from None


def _decoder_layers(model: nn.Module, model_type: str) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TiermoeError(f"{model_type}: {type(model).__name__} has no model.layers; tiermoe cannot find its "
                           "decoder layers")
    return layers


def _moe_block(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """(path in the layer, module) of the module owning a fused experts module, or None for a dense layer."""
    for name, module in layer.named_modules():
        experts = module._modules.get("experts")
        if experts is not None and fused_weight(experts) is not None:
            return name, module
    return None


def _router(block: nn.Module, model_type: str) -> tuple[str, nn.Module]:
    children = {n: c for n, c in block.named_children() if n != "experts"}
    for name in ("gate", "router"):
        if name in children:
            return name, children[name]
    for name, child in children.items():
        if any(w in type(child).__name__ for w in ("Router", "Gate")):
            return name, child
    raise TiermoeError(f"{model_type}: its MoE block {type(block).__name__} has no router module tiermoe can find")


def _shared_intermediate(block: nn.Module) -> int:
    """Intermediate size of the shared experts (their down projection's input), 0 without them."""
    total = 0
    for name, child in block.named_children():
        down = getattr(child, "down_proj", None)
        if name.startswith("shared") and isinstance(down, nn.Linear):
            total += down.in_features
    return total


def _top_k(cfg, block: nn.Module, router: nn.Module, model_type: str) -> int:
    for name in _TOP_K_FIELDS:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value  # ArchSpec refuses a value no model can have, naming it
    for module in (router, block):
        for name in _TOP_K_ATTRS:
            value = getattr(module, name, None)
            if isinstance(value, int) and value > 0:
                return value
    raise TiermoeError(f"{model_type}: tiermoe cannot find how many experts its router picks per token")


def layer_kinds(cfg, layers: nn.ModuleList) -> tuple[str, ...]:
    """Per decoder layer, what it attends with: transformers' cache layer type for the config (full_attention,
    sliding_attention, chunked_attention, indexed_attention, linear_attention, conv, hybrid, ... ; "dummy": no
    attention, or K/V shared from another layer), with the class of a linear-attention (state) module after a
    colon and "+mla" / "+sinks" where the attention has them."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = cfg.get_text_config(decoder=True)
    types, _ = get_layer_types_and_kwargs(text)
    sharing = getattr(text, "kv_sharing_modes", None) or [None] * len(types)
    kinds = []
    for layer, kind, mode in zip(layers, types, sharing):
        mixer = next((c for n, c in layer.named_children() if n in MIXER_NAMES), None)
        if mode == "reuse":
            kind = "kv_shared"
        elif kind in ("linear_attention", "conv", "hybrid", "hybrid_sliding") and mixer is not None:
            kind = f"{kind}:{type(mixer).__name__}"
        parts = list(layer.modules())
        if any(hasattr(m, "kv_a_proj_with_mqa") for m in parts):
            kind += "+mla"
        if any(isinstance(m._parameters.get("sinks"), torch.Tensor) for m in parts):
            kind += "+sinks"
        kinds.append(kind)
    return tuple(kinds)
