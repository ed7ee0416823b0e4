"""Fine-tuning is exact: the hybrid model's loss and every LoRA gradient equal those of the unmodified transformers
model with the same PEFT LoRA, whatever the placement (fp32, with the torch CPU tier an fp32 checkpoint gets; the
native kernels' bf16 / int8 / int4 / int6 CPU tier at its own tolerance: tests/test_training_native_gradients.py).

How exact: each gradient within 1e-6 of the true one per tensor (||g - g_true|| / ||g_true||, the truth being PEFT's
model computed in float64), or, where fp32 cannot get that close, no further than 1.5x PEFT's own fp32 gradients
are: on these tiny models PEFT's fp32 gradients are 1.0e-6 to 1.3e-5 from the float64 ones (Qwen3-Next's linear
attention the most), so no fp32 computation in another order of summation meets 1e-6 everywhere. The loss agrees
with PEFT's fp32 loss to 1e-6.

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
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.lora import apply_lora

pytest.importorskip("peft")

ARCHS = ("qwen3_moe", "deepseek_v3", "mixtral", "glm4_moe")
TOL = 1e-6  # per tensor, against the float64 truth
FLOOR = 1.5  # ... or this many times PEFT's own fp32 error, where that is larger


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, min(vocab, 100), (2, 12), generator=torch.Generator().manual_seed(0))


def _reference_grads(path, config, ids, edit=None):
    ref = peft_reference(path, copy.deepcopy(config))
    if edit is not None:
        edit(ref)
    loss = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    return ref, loss.item(), adapter_grads(ref)


def _true_grads(path, config, ids) -> dict[str, torch.Tensor]:
    """PEFT's gradients computed in float64 (its experts' eager loop: grouped_mm has no float64)."""
    ref = peft_reference(path, copy.deepcopy(config)).double()
    for module in ref.modules():
        if hasattr(getattr(module, "config", None), "_experts_implementation"):
            module.config._experts_implementation = "eager"
    ref(input_ids=ids, labels=ids).loss.backward()
    return adapter_grads(ref)


def _hybrid_grads(path, mask, ref, config, ids):
    hybrid = load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False, trainable=True)
    model = apply_lora(hybrid, copy.deepcopy(config))
    copy_adapters(ref, model)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return hybrid, model, loss.item(), adapter_grads(model)


def _worst(grads, ref_grads) -> float:
    assert set(grads) == set(ref_grads)
    assert all(g is not None for g in grads.values()), [k for k, g in grads.items() if g is None]
    return max(((grads[k].double() - ref_grads[k].double()).norm() / ref_grads[k].double().norm()).item()
               for k in ref_grads)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_dir(arch)
            config = lora_config()
            ids = _ids(load_config(path).vocab_size)
            ref, ref_loss, ref_grads = _reference_grads(path, config, ids)
            truth = _true_grads(path, config, ids)
            bound = max(TOL, FLOOR * _worst(ref_grads, truth))
            cache[arch] = (path, config, ids, ref, ref_loss, truth, bound)
        return cache[arch]

    return get


@pytest.mark.parametrize("kind", ["all_cpu", "random_half", "all_gpu"])
@pytest.mark.parametrize("arch", ARCHS)
def test_loss_and_every_lora_gradient_equal_peft_on_transformers(reference, arch, kind):
    path, config, ids, ref, ref_loss, truth, bound = reference(arch)
    mask = make_mask(kind, detect(load_config(path)))
    hybrid, _, loss, grads = _hybrid_grads(path, mask, ref, config, ids)
    with hybrid:
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
        assert any(k.startswith("layer.") for k in grads), "expert LoRA must be among the checked gradients"
        assert _worst(grads, truth) <= bound


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "deepseek_v2", "qwen3_next", "gpt_oss"])
def test_the_other_architectures_train_exactly_too(reference, arch):
    """Experts on both tiers; on GPT-OSS PEFT's "all-linear" adapts attention only (its experts are transposed and
    PEFT maps no v4 names onto them), so its check is the input gradient through its experts."""
    path, config, ids, ref, ref_loss, truth, bound = reference(arch)
    hybrid, _, loss, grads = _hybrid_grads(path, make_mask("random_half", detect(load_config(path))), ref, config,
                                           ids)
    with hybrid:
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
        assert _worst(grads, truth) <= bound


def test_frozen_experts_get_no_gradient_and_only_adapters_train(reference):
    path, config, ids, ref, *_ = reference("qwen3_moe")
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
    path, config, ids, ref, _, truth, _ = reference("qwen3_moe")
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
        assert _worst(grads, truth) > 1e-3
