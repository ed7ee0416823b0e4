"""Training through the native CPU kernels: the CPU tier's experts stored bf16, int8 or int4 and computed by
tiermoe's C++ kernels, forward and backward (the transposed products), at three placements: all on the CPU tier,
half, all on the GPU tier (the CPU device here, so no kernel runs: the control).

The reference is PEFT's model of the unmodified transformers model whose experts hold what each tier holds (the
CPU tier's dequantised weights). With fp32 activations the kernels multiply exactly those weights and accumulate in
fp32, so only the order of summation differs: their stated tolerance, 1e-5 (tests/test_experts_kernel_matmuls.py),
here for the loss and every LoRA gradient per tensor (||g - g_ref|| / ||g_ref||).
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

from tiermoe.arch import detect, load_config
from tiermoe.config import CPUConfig
from tiermoe.experts.kernel_matmuls import KernelMatmuls
from tiermoe.experts.kernels import supported_isa
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.lora import apply_lora

pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(supported_isa() is None, reason="the kernel library cannot be built here")

TOL = 1e-5  # the kernels' fp32 tolerance
FORMATS = ("bf16", "int8", "int4", "int6")
PLACEMENTS = ("all_cpu", "random_half", "all_gpu")


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, min(vocab, 100), (2, 12), generator=torch.Generator().manual_seed(0))


def _worst(grads, ref_grads) -> float:
    assert set(grads) == set(ref_grads) and all(g is not None for g in grads.values())
    return max(((grads[k] - ref_grads[k]).norm() / ref_grads[k].norm()).item() for k in ref_grads)


def _as_tiers_hold_them(ref, hybrid) -> None:
    """The reference's routed experts become what the hybrid model's tiers hold (CPU tier: dequantised)."""
    with torch.no_grad():
        for layer, block in hybrid.blocks.items():
            experts = ref.base_model.model.model.layers[layer].mlp.experts.get_base_layer()
            for e in range(hybrid.spec.num_experts):
                if e in block.cpu_tier:
                    w = block.cpu_tier.get(e)
                    experts.gate_up_proj[e].copy_(w.gate_up)
                    experts.down_proj[e].copy_(w.down)


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many of each product the kernels computed (the backward's are the transposed ones)."""
    calls = {"gate_up": 0, "down": 0, "gate_up_t": 0, "down_t": 0}
    for name in calls:
        real = getattr(KernelMatmuls, name)

        def counted(self, x, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, x)

        monkeypatch.setattr(KernelMatmuls, name, counted)
    return calls


@pytest.mark.parametrize("kind", PLACEMENTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_lora_gradients_through_the_native_kernels_equal_peft_on_the_experts_they_hold(tiny_dir, kernel_calls,
                                                                                       fmt, kind):
    path = tiny_dir("qwen3_moe")
    config, ids = lora_config(), _ids(load_config(path).vocab_size)
    mask = make_mask(kind, detect(load_config(path)))
    hybrid = load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, cpu=CPUConfig(expert_dtype=fmt),
                               progress=False, trainable=True)
    with hybrid:
        on_cpu = [b for b in hybrid.blocks.values() if len(b.cpu_tier) > 0]
        assert all(b.cpu_tier.path.startswith("kernels/") for b in on_cpu)
        ref = peft_reference(path, copy.deepcopy(config))
        _as_tiers_hold_them(ref, hybrid)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        model = apply_lora(hybrid, copy.deepcopy(config))
        copy_adapters(ref, model)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = adapter_grads(model)
        assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
        assert any(k.startswith("layer.") for k in grads)
        assert _worst(grads, adapter_grads(ref)) <= TOL
    if on_cpu:  # the backward's products ran on the kernels
        assert kernel_calls["gate_up_t"] > 0 and kernel_calls["down_t"] > 0
    else:
        assert sum(kernel_calls.values()) == 0
