"""Would-be host syncs of a whole engine decode step (Engine.step over the paged pool), as a CUDA main device runs it:
transformers' own routers and the attention CUDA chooses (with the grouped GEMM: the Triton kernel over the pool in
place, run by Triton's interpreter; with the Triton GEMM: the gathered path; the CPU device's fused native calls are
not taken on CUDA), the CPU tier's inputs crossing to the host, the GPU tier on either of its grouped kernels.
Exactly one per MoE layer with CPU-tier experts (its inputs in one copy), none for a layer whose experts are all on
the GPU tier, at most three for the rest of the step."""

from __future__ import annotations

import pytest
import torch

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts import slot_pool, triton_grouped
from tiermoe.model import loader
from tiermoe.testing.host_syncs import OUTSIDE, HostSyncCounter

PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [30, 31, 32, 33], [40, 41, 42]]
OUTSIDE_BOUND = 3


# the GPU tier's kernel: torch's grouped GEMM (what the CPU device takes, as an sm90 does for bf16), and the Triton
# one an RTX 3090 (sm86) gets, faked (its choice reads the capability only; run by Triton's interpreter)
KERNELS = {"grouped_mm": None, "triton": (8, 6)}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_decode_step_syncs_once_per_moe_layer_with_cpu_experts_and_not_for_an_all_gpu_one(arch, kernel, tiny_dir,
                                                                                            monkeypatch):
    from tiermoe.arch import detect, load_config

    if KERNELS[kernel] is not None:
        if not triton_grouped.available():
            pytest.skip("triton is not installed")
        monkeypatch.setattr(slot_pool, "device_capability", lambda _: KERNELS[kernel])
    monkeypatch.setattr(loader, "fuse_layer_ops", lambda model: None)  # CUDA keeps transformers' routers
    if KERNELS[kernel] is None:  # and the attention a CUDA device gets (on one kernel: the interpreter is slow)
        chosen = loader.decode_attention_for
        monkeypatch.setattr(loader, "decode_attention_for", lambda model, device, *args: chosen(
            model, torch.device("cuda"), *args))
    else:  # the gathered path a CUDA device without the kernel takes
        monkeypatch.setattr(loader, "decode_attention_for", lambda *args: None)
    path = tiny_dir(arch)
    spec = detect(load_config(path))
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    first, *rest = spec.moe_layers
    mask[first] = True  # an all-GPU layer
    for layer in rest:
        mask[layer, ::2] = True  # the others: half on each tier
    with LLM(path, placement=mask, dtype=torch.float32, progress=False) as llm:
        engine = llm.engine
        for prompt in PROMPTS:
            engine.add(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        while any(seq.num_fed < len(seq.prompt_ids) for seq in engine.running + list(engine.waiting)):
            engine.step()  # the prompts through: the next step decodes every sequence
        assert {b.gpu_tier.pool.kernel(torch.float32).name for b in llm.hybrid.blocks.values()} == {kernel}
        with HostSyncCounter(llm.hybrid) as counter:
            produced = engine.step()
        engine.run_to_completion()
    assert len(produced) == len(PROMPTS)
    print(f"\n{arch}, one decode step of {len(PROMPTS)} sequences, would-be host syncs:\n{counter.describe()}")
    assert counter.count(first) == 0, counter.describe()
    for layer in rest:
        assert counter.count(layer) == 1, counter.describe()
    assert counter.count(OUTSIDE) <= OUTSIDE_BOUND, counter.describe()
