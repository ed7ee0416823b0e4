"""LoRA on a hybrid model the way users already write it: a PEFT LoraConfig, applied as PEFT applies it to the
unmodified transformers model.

PEFT resolves a config against the model first (on transformers 5 it maps v4 names onto fused parameters:
"all-linear" or gate_proj/up_proj/down_proj become LoRA on `mlp.experts.gate_up_proj` (twice the rank and alpha)
and `mlp.experts.down_proj`, and the router's `gate.weight`). tiermoe resolves the config the same way, then
splits it: the fused-expert parameters become an ExpertLoRA on each MoE block (the routed experts live in the
tiers, not in the module tree, so PEFT cannot reach them); everything else (attention, dense projections, the
router) goes to PEFT's own `get_peft_model` on `hybrid.model`. The adapted model therefore computes what PEFT's
model computes, and its expert factors are saved in PEFT's layout (tiermoe.training.peft_layout).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch
from torch import nn

from tiermoe.errors import TiermoeError
from tiermoe.layers.expert_lora import ExpertLoRA
from tiermoe.model.hybrid_model import HybridModel
from tiermoe.training.adapter_weights import attach_adapter_io

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # transformers' fused routed-expert parameters, in this order
MAX_RANK = 4096  # a rank above the model's width only wastes memory; this bound catches a typo


@dataclass(frozen=True)
class ExpertTargets:
    """LoRA on the routed experts: (gate_up, down) ranks and alphas, as PEFT resolved them."""

    ranks: tuple[int, int]
    alphas: tuple[float, float]
    rslora: bool = False


def resolve(model: nn.Module, config, experts: bool | None = None):
    """(the config PEFT applies to `model`'s modules, or None; ExpertTargets or None).

    experts None: LoRA on routed experts as `config` says (after PEFT's name mapping); True: on them in any case,
    at the config's rank; False: not on them.
    """
    config = copy.deepcopy(config)
    _convert_like_peft(config, model)
    params = set(config.target_parameters or ())
    fused = {p for p in params if p.rsplit(".", 1)[-1] in EXPERT_PARAMS}
    if experts and not fused:
        fused = {f"mlp.experts.{name}" for name in EXPERT_PARAMS}
    targets = None
    if fused and experts is not False:
        named = {p.rsplit(".", 1)[-1] for p in fused}
        if named != set(EXPERT_PARAMS):
            raise TiermoeError(f"LoRA on {sorted(named)} alone: tiermoe adapts both routed-expert projections "
                               f"({', '.join(EXPERT_PARAMS)}) or neither")
        ranks = tuple(_pattern(config.rank_pattern, name, config.r) for name in EXPERT_PARAMS)
        alphas = tuple(float(_pattern(config.alpha_pattern, name, config.lora_alpha)) for name in EXPERT_PARAMS)
        targets = ExpertTargets(ranks, alphas, bool(config.use_rslora))
    config.target_parameters = sorted(params - fused) or None
    for patterns in (config.rank_pattern, config.alpha_pattern):  # PEFT would warn that they match nothing
        for pattern in [p for p in (patterns or {}) if any(_matches(p, name) for name in EXPERT_PARAMS)]:
            del patterns[pattern]
    has_modules = bool(config.target_modules) or bool(config.target_parameters)
    return (config if has_modules else None), targets


def add_expert_lora(hybrid: HybridModel, targets: ExpertTargets) -> dict[int, ExpertLoRA]:
    """An ExpertLoRA on every MoE block (fp32 factors on the main device, as PEFT keeps adapters in fp32)."""
    if not hybrid.trainable:
        raise TiermoeError("expert LoRA needs a model loaded for training: load_hybrid_model(..., trainable=True)")
    if max(targets.ranks) > MAX_RANK:
        raise TiermoeError(f"LoRA rank {max(targets.ranks)} is above {MAX_RANK}")
    added = {}
    for layer, block in hybrid.blocks.items():
        d, i = _expert_shape(block)
        block.lora_experts = ExpertLoRA(hybrid.spec.num_experts, d, i, targets.ranks, targets.alphas, targets.rslora,
                                        device=hybrid.gpu_device, dtype=torch.float32)
        added[layer] = block.lora_experts
    return added


def apply_lora(hybrid: HybridModel, config, experts: bool | None = None) -> nn.Module:
    """The model to train: `hybrid.model` with `config` (a peft.LoraConfig) applied as PEFT applies it to the
    transformers model, routed experts included (see `resolve` for `experts`). Returns a PeftModel, or
    `hybrid.model` itself when only routed experts are adapted; only adapter weights are trainable afterwards, and
    the model's `save_pretrained` writes the whole adapter in PEFT's layout (tiermoe.training.adapter_weights)."""
    module_config, targets = resolve(hybrid.model, config, experts)
    if targets is not None:
        add_expert_lora(hybrid, targets)
    if module_config is None:
        if targets is None:
            raise TiermoeError("the LoRA config targets nothing in this model")
        for name, p in hybrid.model.named_parameters():
            p.requires_grad_(".lora_experts." in name)
        return attach_adapter_io(hybrid.model)
    from peft import get_peft_model  # the [train] extra

    try:
        model = get_peft_model(hybrid.model, module_config)
    except ValueError as e:  # PEFT's own refusals (a target that matches nothing, dropout on a parameter, ...)
        raise TiermoeError(f"PEFT refused the LoRA config: {e}") from None
    for block in hybrid.blocks.values():  # PEFT froze everything it did not add itself
        if block.lora_experts is not None:
            block.lora_experts.requires_grad_(True)
    return attach_adapter_io(model)  # save_pretrained / load_adapter (Trainer's checkpoints) keep the expert LoRA


def _convert_like_peft(config, model: nn.Module) -> None:
    """PEFT's own mapping of a config onto a transformers 5 MoE model (in place), when this PEFT has one."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # an older PEFT maps nothing: the config applies as written
        return
    convert_peft_config_for_transformers(config, model=model, conversions=None)


def _matches(pattern: str, name: str) -> bool:
    """Whether a rank_pattern / alpha_pattern key names the fused parameter `name` (PEFT's own matching rule)."""
    return re.match(rf"(.*\.)?({pattern})$", f"model.layers.0.mlp.experts.{name}") is not None


def _pattern(patterns: dict | None, name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup for the fused parameter `name` of any layer."""
    return next((value for pattern, value in (patterns or {}).items() if _matches(pattern, name)), default)


def _expert_shape(block) -> tuple[int, int]:
    """(D, I) of a block's routed experts, read from one it holds."""
    for tier in (block.gpu_tier, block.cpu_tier):
        for e in range(block.spec.num_experts):
            if e in tier:
                w = tier.get(e)
                return w.down.shape[0], w.down.shape[1]
    raise TiermoeError(f"layer {block.layer} holds no routed expert on either tier")
