"""Switching a hybrid model's adapter off, or to a frozen copy, routed-expert LoRA included: the reference model of
preference tuning (DPO) with no second copy of the experts.

PEFT's way to get a reference without a second model is the adapted model itself with its adapters off
(`disable_adapter()`), or with a frozen copy of the adapter made active (`add_adapter("ref", ...)` then
`set_adapter("ref")`, what TRL's DPOTrainer does with `ref_model=None` on PEFT >= 0.20). PEFT switches only the
adapters it made; the routed experts' LoRA lives in the MoE blocks (tiermoe.layers.expert_lora), so these switches
are extended to it here: off means each block runs its frozen experts alone, and a named copy holds its own
ExpertLoRA (adapter-sized, on the main device) that the block uses while that adapter is active. The experts
themselves are never copied.
"""

from __future__ import annotations

import contextlib
import copy

from torch import nn

from tiermoe.layers.expert_lora import ExpertLoRA
from tiermoe.training.adapter_layout import ADAPTER


def attach_adapter_switch(model: nn.Module, blocks: dict) -> nn.Module:
    """Make a PeftModel's `disable_adapter`, `add_adapter` and `set_adapter` cover the expert LoRA of `blocks`
    ({layer: HybridMoE}); a model without PEFT adapters is returned as it is."""
    if not hasattr(model, "peft_config"):
        return model
    peft_disable, peft_add, peft_set = model.disable_adapter, model.add_adapter, model.set_adapter
    by_name: dict[str, dict[int, ExpertLoRA]] = {ADAPTER: _current(blocks)}

    @contextlib.contextmanager
    def disable_adapter():
        held = _current(blocks)
        with peft_disable():
            _use(blocks, {})
            try:
                yield
            finally:
                _use(blocks, held)

    def add_adapter(adapter_name: str, peft_config, *args, **kwargs):
        result = peft_add(adapter_name, peft_config, *args, **kwargs)
        # a frozen copy of the active expert LoRA: TRL copies the module adapter's values into the new one too
        by_name[adapter_name] = {layer: copy.deepcopy(lora).requires_grad_(False)
                                 for layer, lora in _current(blocks).items()}
        return result

    def set_adapter(adapter_name, *args, **kwargs):
        result = peft_set(adapter_name, *args, **kwargs)
        if isinstance(adapter_name, str) and adapter_name in by_name:
            _use(blocks, by_name[adapter_name])
        return result

    model.disable_adapter, model.add_adapter, model.set_adapter = disable_adapter, add_adapter, set_adapter
    return model


def _current(blocks: dict) -> dict[int, ExpertLoRA]:
    return {layer: block.lora_experts for layer, block in blocks.items() if block.lora_experts is not None}


def _use(blocks: dict, loras: dict[int, ExpertLoRA]) -> None:
    for layer, block in blocks.items():
        block.lora_experts = loras.get(layer)
