"""The reference for fine-tuning tests: the unmodified transformers model with PEFT LoRA on the same targets.

LoRA on routed experts goes through PEFT's `target_parameters` (a ParamWrapper per fused expert parameter), module
LoRA through "all-linear"; `init_lora_weights=False` makes every factor random (B non-zero), so each gradient is
exercised. `copy_adapters` puts the reference's adapter values into a hybrid model's adapters.
"""

from __future__ import annotations

import re

import pytest
import torch

from tiermoe.training.peft_layout import from_peft


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Training tests run torch single-threaded (import this fixture into the test module): tiny models gain
    nothing from a second intra-op thread, and on a loaded 2-core machine two threads spin-wait on each other
    (a small matmul then takes milliseconds instead of microseconds)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def lora_config(rank: int = 4, alpha: float = 8.0, target_modules="all-linear"):
    """On transformers 5, PEFT maps "all-linear" onto attention, the router and both fused expert parameters."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, init_lora_weights=False)


def peft_reference(path, config, seed: int = 0):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    return get_peft_model(model, config)


def expert_wrappers(peft_model):
    """{(layer, 'gate_up' | 'down'): PEFT ParamWrapper} of a reference model."""
    found = {}
    for name, module in peft_model.named_modules():
        if type(module).__name__ == "ParamWrapper" and module.parameter_name in ("gate_up_proj", "down_proj"):
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
            found[(layer, module.parameter_name.removesuffix("_proj"))] = module
    return found


def copy_adapters(reference, trained) -> None:
    """Every adapter value of `reference` (a PEFT model of the plain transformers model) into `trained` (the
    hybrid model after tiermoe.training.apply_lora)."""
    ours = dict(trained.named_parameters())
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_" in name and ".experts." not in name:
                ours[name].copy_(p)
        blocks = {int(re.search(r"layers\.(\d+)\.", n).group(1)): m for n, m in trained.named_modules()
                  if type(m).__name__ == "ExpertLoRA"}
        for (layer, proj), wrapper in expert_wrappers(reference).items():
            lora = blocks[layer]
            a, b = from_peft(wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight, lora.gate_up_A.shape[0])
            getattr(lora, f"{proj}_A").copy_(a)
            getattr(lora, f"{proj}_B").copy_(b)


def adapter_grads(model) -> dict[str, torch.Tensor]:
    """Every LoRA gradient by a name both models share: module LoRA by parameter name, expert LoRA as
    'layer.{L}.{gate_up|down}.{A|B}' in tiermoe's [E, ...] layout."""
    grads = {}
    for name, p in model.named_parameters():
        if "lora_" not in name or ".experts." in name or ".lora_experts." in name:
            continue
        grads[name] = p.grad
    for name, m in model.named_modules():
        if type(m).__name__ == "ExpertLoRA":
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
            for proj in ("gate_up", "down"):
                for f in "AB":
                    grads[f"layer.{layer}.{proj}.{f}"] = getattr(m, f"{proj}_{f}").grad
    for (layer, proj), wrapper in expert_wrappers(model).items():
        num_experts = wrapper.num_experts
        a, b = from_peft(wrapper.lora_A["default"].weight.grad, wrapper.lora_B["default"].weight.grad, num_experts)
        grads[f"layer.{layer}.{proj}.A"], grads[f"layer.{layer}.{proj}.B"] = a, b
    return grads
