"""The GPU tier's kernel by compute capability and dtype (tiermoe.experts.gpu_tier_kernel): on every CUDA device our
users own, a kernel that queues a layer without the host waiting; torch._grouped_mm only where it runs on the device
alone (bf16 on sm90/sm100), never its host-loop fallback. Devices are faked: the choice reads the capability only."""

from __future__ import annotations

import pytest
import torch

from tiermoe.experts import slot_pool
from tiermoe.experts.ffn import ExpertActivation
from tiermoe.experts.gpu_tier_kernel import choose_kernel
from tiermoe.experts.slot_pool import ExpertSlotPool
from tiermoe.experts.slotted_tier import SlottedExpertSet
from tiermoe.experts.weights import ExpertWeights

CAPABILITIES = {"sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0)}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", list(CAPABILITIES))
def test_the_pool_chooses_a_sync_free_kernel_on_every_capability(device, dtype, monkeypatch):
    monkeypatch.setattr(slot_pool, "device_capability", lambda _: CAPABILITIES[device])
    pool = ExpertSlotPool("cpu")  # a CUDA device of that capability, as far as the choice can tell
    tier = SlottedExpertSet(ExpertActivation("silu_glu"), 4, pool)
    tier.add(0, ExpertWeights(torch.zeros(8, 16, dtype=dtype), torch.zeros(16, 4, dtype=dtype)))
    choice = pool.kernel(dtype)
    assert choice.sync_free, choice
    grouped_mm_is_sync_free = dtype == torch.bfloat16 and device in ("sm90", "sm100")
    assert (choice.name == "grouped_mm") == grouped_mm_is_sync_free, choice


@pytest.mark.parametrize("device", list(CAPABILITIES))
def test_fp8_layers_get_slots_on_the_kernel_that_decodes_their_codes(device, monkeypatch):
    monkeypatch.setattr(slot_pool, "device_capability", lambda _: CAPABILITIES[device])
    for dtype in (torch.bfloat16, torch.float16):
        choice = slot_pool.fp8_kernel(torch.device("cpu"), dtype)  # what the loader asks for an FP8 layer
        assert choice.sync_free and choice.name == "triton" and "FP8" in choice.why


def test_without_triton_a_cuda_device_says_it_syncs_and_a_cpu_device_takes_what_torch_takes():
    choice = choose_kernel((8, 6), torch.bfloat16, triton_available=False)
    assert choice.name == "per_expert" and not choice.sync_free and "host syncs" in choice.why
    assert choose_kernel(None, torch.float32, grouped_mm_runs=True).name == "grouped_mm"
    assert choose_kernel(None, torch.float32, grouped_mm_runs=False).name == "per_expert"


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])  # gpt_oss: expert biases and its clamped GLU
def test_a_model_on_the_triton_kernel_gives_transformers_logits(arch, tiny_dir, monkeypatch):
    from conftest import load_reference, logits_on_tier, rel_err

    from tiermoe.experts import triton_grouped

    if not triton_grouped.available():
        pytest.skip("triton is not installed")
    launches = []
    real = triton_grouped.grouped_matmul
    monkeypatch.setattr(triton_grouped, "grouped_matmul", lambda *a, **k: launches.append(1) or real(*a, **k))
    monkeypatch.setattr(slot_pool, "device_capability", lambda _: CAPABILITIES["sm86"])  # an RTX 3090's choice
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_reference(tiny_dir(arch))(input_ids=ids).logits
        got = logits_on_tier(tiny_dir(arch), "random_half", ids)
    assert launches and rel_err(got, want) <= 1e-5
