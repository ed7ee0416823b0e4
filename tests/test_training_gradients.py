"""Fine-tuning is exact: the hybrid model's loss and every LoRA gradient equal those of the unmodified transformers
model with the same PEFT LoRA, whatever the placement (fp32, ||g - g_ref|| / ||g_ref|| <= 1e-5 per tensor).

The config is PEFT's "all-linear", which on transformers 5 means attention, the router and both fused expert
parameters (tests/training_reference.py), so routed-expert LoRA on both tiers, router LoRA and the input gradient
through every expert layer are all exercised.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_mask
from training_reference import (
    adapter_grads,
    copy_adapters,
    lora_config,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
    peft_reference,
)

import tiermoe.layers.routed_autograd as routed_autograd
from tiermoe.arch import detect, load_config
from tiermoe.config import CPUConfig
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.lora import apply_lora

pytest.importorskip("peft")

ARCHS = ("qwen3_moe", "deepseek_v3", "mixtral", "glm4_moe")
TOL = 1e-5


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, min(vocab, 100), (2, 12), generator=torch.Generator().manual_seed(0))


def _reference_grads(path, config, ids, edit=None):
    ref = peft_reference(path, copy.deepcopy(config))
    if edit is not None:
        edit(ref)
    loss = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    return ref, loss.item(), adapter_grads(ref)


def _hybrid_grads(path, mask, ref, config, ids, cpu: CPUConfig = CPUConfig()):
    hybrid = load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, cpu=cpu, progress=False,
                               trainable=True)
    model = apply_lora(hybrid, copy.deepcopy(config))
    copy_adapters(ref, model)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return hybrid, model, loss.item(), adapter_grads(model)


def _worst(grads, ref_grads) -> float:
    assert set(grads) == set(ref_grads)
    assert all(g is not None for g in grads.values()), [k for k, g in grads.items() if g is None]
    return max(((grads[k] - ref_grads[k]).norm() / ref_grads[k].norm()).item() for k in ref_grads)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_dir(arch)
            config = lora_config()
            ids = _ids(load_config(path).vocab_size)
            cache[arch] = (path, config, ids, *_reference_grads(path, config, ids))
        return cache[arch]

    return get


@pytest.mark.parametrize("kind", ["all_cpu", "random_half", "all_gpu"])
@pytest.mark.parametrize("arch", ARCHS)
def test_loss_and_every_lora_gradient_equal_peft_on_transformers(reference, arch, kind):
    path, config, ids, ref, ref_loss, ref_grads = reference(arch)
    mask = make_mask(kind, detect(load_config(path)))
    hybrid, _, loss, grads = _hybrid_grads(path, mask, ref, config, ids)
    with hybrid:
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
        assert any(k.startswith("layer.") for k in grads), "expert LoRA must be among the checked gradients"
        assert _worst(grads, ref_grads) <= TOL


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "deepseek_v2", "qwen3_next", "gpt_oss"])
def test_the_other_architectures_train_exactly_too(reference, arch):
    """Experts on both tiers; on GPT-OSS PEFT's "all-linear" adapts attention only (its experts are transposed and
    PEFT maps no v4 names onto them), so its check is the input gradient through its experts."""
    path, config, ids, ref, ref_loss, ref_grads = reference(arch)
    hybrid, _, loss, grads = _hybrid_grads(path, make_mask("random_half", detect(load_config(path))), ref, config,
                                           ids)
    with hybrid:
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
        assert _worst(grads, ref_grads) <= TOL


def test_frozen_experts_get_no_gradient_and_only_adapters_train(reference):
    path, config, ids, ref, _, _ = reference("qwen3_moe")
    mask = make_mask("random_half", detect(load_config(path)))
    hybrid, model, _, _ = _hybrid_grads(path, mask, ref, config, ids)
    with hybrid:
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable)
        for block in hybrid.blocks.values():
            for tier in (block.gpu_tier, block.cpu_tier):
                for e in range(hybrid.spec.num_experts):
                    if e in tier:
                        w = tier.get(e)
                        assert not w.gate_up.requires_grad and w.gate_up.grad is None


def test_a_cpu_backward_that_drops_one_expert_is_caught(reference, monkeypatch):
    """The check above must be able to fail: expert 0's input gradient through the CPU tier goes missing."""
    path, config, ids, ref, _, ref_grads = reference("qwen3_moe")
    real = routed_autograd.matmuls_of

    def dropping(tier, expert, dtype):
        mm = real(tier, expert, dtype)
        if expert == 0 and hasattr(tier, "submit"):  # the CPU tier
            mm.down_t = lambda g: torch.zeros(g.shape[0], mm.w.down.shape[1], dtype=g.dtype)
        return mm

    monkeypatch.setattr(routed_autograd, "matmuls_of", dropping)
    mask = make_mask("all_cpu", detect(load_config(path)))
    hybrid, _, _, grads = _hybrid_grads(path, mask, ref, config, ids)
    with hybrid:
        assert _worst(grads, ref_grads) > 1e-3


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantised_cpu_experts_train_exactly_on_their_dequantised_weights(tiny_dir, fmt):
    """Over int8/int4 CPU experts the gradients are those of the transformers model whose experts are the CPU
    tier's dequantised weights."""
    path = tiny_dir("qwen3_moe")
    config, ids = lora_config(), _ids(load_config(path).vocab_size)
    spec = detect(load_config(path))
    mask = make_mask("random_half", spec)
    hybrid = load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, cpu=CPUConfig(expert_dtype=fmt),
                               progress=False, trainable=True)
    with hybrid:
        def dequantised_experts(ref):
            with torch.no_grad():
                for layer, block in hybrid.blocks.items():
                    experts = ref.base_model.model.model.layers[layer].mlp.experts.get_base_layer()
                    for e in range(spec.num_experts):
                        if e in block.cpu_tier:
                            w = block.cpu_tier.get(e)
                            experts.gate_up_proj[e].copy_(w.gate_up)
                            experts.down_proj[e].copy_(w.down)

        ref, ref_loss, ref_grads = _reference_grads(path, config, ids, dequantised_experts)
        model = apply_lora(hybrid, copy.deepcopy(config))
        copy_adapters(ref, model)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert abs(loss.item() - ref_loss) <= TOL * abs(ref_loss)
        assert _worst(adapter_grads(model), ref_grads) <= TOL
