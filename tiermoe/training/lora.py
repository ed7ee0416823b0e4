"""LoRA on a hybrid model the way users already write it: a PEFT LoraConfig, applied as PEFT applies it to the
unmodified transformers model.

PEFT resolves a config against the model first (on transformers 5 it maps v4 names onto fused parameters:
"all-linear" or gate_proj/up_proj/down_proj become LoRA on `mlp.experts.gate_up_proj` (twice the rank and alpha)
and `mlp.experts.down_proj`, and the router's `gate.weight`). tiermoe resolves the config the same way, then
splits it (`plan_lora`): the fused-expert parameters become an ExpertLoRA on each MoE block they reach (the routed
experts live in the tiers, not in the module tree, so PEFT cannot reach them); everything else (attention, dense
projections, the router) goes to PEFT's own `get_peft_model` on `hybrid.model`. The adapted model therefore computes
what PEFT's model computes, and its expert factors are saved in PEFT's layout (tiermoe.training.peft_layout).

Every LoraConfig field is honoured for modules and routed experts alike or refused in one line
(tiermoe.training.lora_fields). Where PEFT itself is narrower for parameters than for modules (it applies
`layers_to_transform` and `exclude_modules` to modules only), tiermoe applies them to parameters too, and the config
it saves names the adapted layers' parameters one by one, which PEFT honours: the saved adapter rebuilds the same
wrappers in PEFT. An adapter read from disk is rebuilt exactly as PEFT laid it out (`layout`), whatever its config.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from tiermoe.errors import TiermoeError
from tiermoe.layers.expert_lora import ExpertLoRA
from tiermoe.model.hybrid_model import HybridModel
from tiermoe.model.skeleton import build_skeleton
from tiermoe.training.adapter_layout import AdapterLayout
from tiermoe.training.adapter_switch import attach_adapter_switch
from tiermoe.training.adapter_weights import attach_adapter_io
from tiermoe.training.lora_fields import check_lora_config
from tiermoe.training.lora_matching import (
    filtered_parameters,
    module_targets,
    named_by,
    pattern_value,
    pin_patterns,
    targeted,
)

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # transformers' fused routed-expert parameters, in this order
MAX_RANK = 4096  # a rank above the model's width only wastes memory; this bound catches a typo
# PEFT's note that a rank / alpha pattern matched none of the modules it wraps: expert patterns match the experts,
# which tiermoe adapts, not PEFT
PATTERN_WARNING = r"The following (rank|alpha)_pattern keys did not match"


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's expert LoRA: (gate_up, down) ranks and alphas, as PEFT resolves them for its parameters."""

    ranks: tuple[int, int]
    alphas: tuple[float, float]


@dataclass
class LoraPlan:
    """Where a LoraConfig goes on one hybrid model.

    module_config: what PEFT's get_peft_model applies to `hybrid.model` (None: nothing there); experts: {MoE layer:
    its ExpertLayer}; saved_config: what PEFT applies to the transformers model to rebuild the same adapter."""

    module_config: object | None
    experts: dict[int, ExpertLayer]
    rslora: bool
    init: bool | str
    trainable: bool
    saved_config: object


def plan_lora(hybrid: HybridModel, config, experts: bool | None = None,
              layout: AdapterLayout | None = None) -> LoraPlan:
    """How `config` (a peft.LoraConfig) lands on `hybrid`, every field checked (tiermoe.training.lora_fields).

    experts None: LoRA on routed experts as `config` says (after PEFT's name mapping); True: on them in any case,
    at the config's rank (its layer filters still apply); False: not on them. layout: the adapter read from disk
    this config came with: its expert LoRA goes exactly where PEFT put it."""
    config = copy.deepcopy(config)
    _convert_like_peft(config, hybrid.model.config)
    keys = _expert_keys(hybrid)
    entries = sorted(config.target_parameters or ())
    expert_entries = [p for p in entries if any(named_by(p, k) for _, params in keys.values() for k in params.values())]
    other_entries = [p for p in entries if p not in expert_entries]
    if layout is not None:
        chosen = _layers_of_layout(layout, bool(config.use_rslora))
        saved_entries = expert_entries
    elif experts is False:
        chosen, saved_entries = {}, []
    else:
        wanted = expert_entries or (list(EXPERT_PARAMS) if experts else [])
        chosen = _chosen_layers(config, keys, wanted)
        saved_entries = _saved_expert_entries(config, keys, wanted, chosen)
        other_entries = filtered_parameters(config, hybrid.model, other_entries)
    if chosen and hybrid.spec.disk.fused_kind != "transformers":
        raise TiermoeError(f"LoRA on the routed experts of a {hybrid.spec.model_type} model (expert layout "
                           f"{hybrid.spec.disk.fused_kind}) is not supported; adapt its modules only (experts=False)")
    check_lora_config(config, adapts_parameters=bool(chosen) or bool(other_entries), reading=layout is not None)
    _check_ranks(config, chosen)
    module_config = copy.deepcopy(config)
    module_config.target_parameters = other_entries or None
    has_modules = bool(module_config.target_modules) or bool(other_entries)
    saved = copy.deepcopy(config)
    saved.target_parameters = sorted(set(other_entries) | set(saved_entries)) or None
    if layout is None:
        expert_targets = [k for layer in chosen for k in keys[layer][1].values()]
        pin_patterns(saved, expert_targets + module_targets(module_config, hybrid.model))
    if not has_modules and not chosen:
        raise TiermoeError("the LoRA config targets nothing in this model")
    return LoraPlan(module_config if has_modules else None, chosen, bool(config.use_rslora), config.init_lora_weights,
                    not config.inference_mode, saved)


def add_expert_lora(hybrid: HybridModel, plan: LoraPlan) -> dict[int, ExpertLoRA]:
    """An ExpertLoRA on every MoE block the plan names (fp32 factors on the main device, as PEFT keeps adapters in
    fp32), initialised as PEFT initialises its ParamWrappers."""
    if not hybrid.trainable:
        raise TiermoeError("expert LoRA needs a model loaded for training: load_hybrid_model(..., trainable=True)")
    added = {}
    for layer, target in plan.experts.items():
        block = hybrid.blocks[layer]
        d, i = _expert_shape(block)
        lora = ExpertLoRA(hybrid.spec.num_experts, d, i, target.ranks, target.alphas, plan.rslora,
                          device=hybrid.gpu_device, dtype=torch.float32)
        _initialise(lora, plan.init)
        block.lora_experts = added[layer] = lora
    return added


def apply_lora(hybrid: HybridModel, config, experts: bool | None = None) -> nn.Module:
    """The model to train: `hybrid.model` with `config` (a peft.LoraConfig) applied as PEFT applies it to the
    transformers model, routed experts included (see `plan_lora` for `experts`). Returns a PeftModel, or
    `hybrid.model` itself when only routed experts are adapted; only adapter weights are trainable afterwards (none
    with inference_mode), and the model's `save_pretrained` writes the whole adapter in PEFT's layout
    (tiermoe.training.adapter_weights). A field of the config tiermoe cannot honour is a one-line TiermoeError."""
    return build_lora(hybrid, plan_lora(hybrid, config, experts))


def build_lora(hybrid: HybridModel, plan: LoraPlan) -> nn.Module:
    """The adapters of `plan` on `hybrid` (see apply_lora)."""
    if plan.experts:
        add_expert_lora(hybrid, plan)
    if plan.module_config is None:
        for name, p in hybrid.model.named_parameters():
            p.requires_grad_(plan.trainable and ".lora_experts." in name)
        return attach_adapter_io(hybrid.model, plan.saved_config)
    from peft import get_peft_model  # the [train] extra

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=PATTERN_WARNING)
            model = get_peft_model(hybrid.model, plan.module_config)
    except ValueError as e:  # PEFT's own refusals (a target that matches nothing, ...)
        raise TiermoeError(f"PEFT refused the LoRA config: {' '.join(str(e).split())}") from None
    for block in hybrid.blocks.values():  # PEFT froze everything it did not add itself
        if block.lora_experts is not None:
            block.lora_experts.requires_grad_(plan.trainable)
    model = attach_adapter_io(model, plan.saved_config)  # save_pretrained / load_adapter keep the expert LoRA
    return attach_adapter_switch(model, hybrid.blocks)  # adapters off (a DPO reference) turns expert LoRA off


def _convert_like_peft(config, model_config) -> None:
    """PEFT's own mapping of a config onto a transformers 5 MoE model (in place), when this PEFT has one.

    It runs on a meta skeleton of the transformers model, not on the hybrid one: PEFT (0.22 on) turns a module target
    into a parameter target only where the model holds such a parameter outside nn.Linear, and the hybrid model holds
    its routed experts in tiers, not in the fused `experts` parameters PEFT looks for."""
    try:
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers,
        )
    except ImportError:  # an older PEFT maps nothing: the config applies as written
        return
    try:
        convert_peft_config_for_transformers(config, model=build_skeleton(model_config, torch.float32),
                                             conversions=None)
    except ValueError as e:  # e.g. gate_proj without up_proj, which transformers 5 fuses into one parameter
        raise TiermoeError(f"PEFT cannot map the LoRA targets onto this model: {' '.join(str(e).split())}") from None


def _expert_keys(hybrid: HybridModel) -> dict[int, tuple[str, dict[str, str]]]:
    """{MoE layer: (the experts module's name, {fused parameter: its full name})} as in the transformers model."""
    names = {id(m): n for n, m in hybrid.model.named_modules()}
    keys = {}
    for layer, block in hybrid.blocks.items():
        module = f"{names[id(block)]}.experts"
        keys[layer] = (module, {p: f"{module}.{p}" for p in EXPERT_PARAMS})
    return keys


def _chosen_layers(config, keys, entries: list[str]) -> dict[int, ExpertLayer]:
    chosen = {}
    for layer, (module, params) in keys.items():
        hit = [p for p in EXPERT_PARAMS if targeted(config, entries, params[p], module)]
        if not hit:
            continue
        if len(hit) != len(EXPERT_PARAMS):
            raise TiermoeError(f"LoRA on layer {layer}'s {hit[0]} alone: tiermoe adapts both routed-expert "
                               f"projections ({', '.join(EXPERT_PARAMS)}) of a layer or neither")
        ranks = tuple(int(pattern_value(config.rank_pattern, params[p], config.r)) for p in EXPERT_PARAMS)
        alphas = tuple(float(pattern_value(config.alpha_pattern, params[p], config.lora_alpha)) for p in EXPERT_PARAMS)
        chosen[layer] = ExpertLayer(ranks, alphas)
    return chosen


def _saved_expert_entries(config, keys, entries: list[str], chosen: dict[int, ExpertLayer]) -> list[str]:
    """The expert target_parameters to save: the entries themselves when PEFT (which applies neither exclusions nor
    layer filters to parameters) reaches exactly the chosen layers with them, else each chosen parameter's name."""
    peft_reaches = {layer for layer, (_, params) in keys.items()
                    if any(named_by(e, params[p]) for e in entries for p in EXPERT_PARAMS)}
    if peft_reaches == set(chosen):
        return list(entries)
    return [keys[layer][1][p] for layer in sorted(chosen) for p in EXPERT_PARAMS]


def _check_ranks(config, chosen: dict[int, ExpertLayer]) -> None:
    """Every rank between 1 and MAX_RANK: a rank sizes the adapter's memory."""
    ranks = [config.r, *(config.rank_pattern or {}).values(), *(r for t in chosen.values() for r in t.ranks)]
    bad = next((r for r in ranks if not isinstance(r, int) or not 1 <= r <= MAX_RANK), None)
    if bad is not None:
        raise TiermoeError(f"LoRA rank {bad!r} is outside 1 ... {MAX_RANK}; expected an integer rank in that range")


def _layers_of_layout(layout: AdapterLayout, rslora: bool) -> dict[int, ExpertLayer]:
    """The expert LoRA PEFT laid out for a saved adapter: its layers, ranks and scalings."""
    found: dict[int, dict[str, tuple[int, float]]] = {}
    for target in layout.targets.values():
        if target.is_experts:
            found.setdefault(target.layer, {})[target.param] = (target.rank, target.scaling)
    chosen = {}
    for layer, params in sorted(found.items()):
        if set(params) != set(EXPERT_PARAMS):
            raise TiermoeError(f"the adapter has LoRA on layer {layer}'s {next(iter(params))} alone: tiermoe adapts "
                               f"both routed-expert projections ({', '.join(EXPERT_PARAMS)}) of a layer or neither")
        ranks = tuple(params[p][0] for p in EXPERT_PARAMS)
        alphas = tuple(params[p][1] * (math.sqrt(params[p][0]) if rslora else params[p][0]) for p in EXPERT_PARAMS)
        chosen[layer] = ExpertLayer(ranks, alphas)
    return chosen


def _initialise(lora: ExpertLoRA, init) -> None:
    """PEFT's initialisation of its ParamWrapper factors (A [r*E, in] and B [out, r*E] as nn.Linear weights)."""
    with torch.no_grad():
        if init is False:  # both keep nn.Linear's default: B's fan-in is r*E
            for b in (lora.gate_up_B, lora.down_B):
                bound = 1 / math.sqrt(b.shape[0] * b.shape[2])
                nn.init.uniform_(b, -bound, bound)
        elif init == "gaussian":
            for a, r in zip((lora.gate_up_A, lora.down_A), lora.ranks, strict=True):
                nn.init.normal_(a, std=1 / r)


def _expert_shape(block) -> tuple[int, int]:
    """(D, I) of a block's routed experts, read from one it holds."""
    for tier in (block.gpu_tier, block.cpu_tier):
        for e in range(block.spec.num_experts):
            if e in tier:
                w = tier.get(e)
                return w.down.shape[0], w.down.shape[1]
    raise TiermoeError(f"layer {block.layer} holds no routed expert on either tier")
