"""Dynamic placement: layerwise GPU prefill, KT-compatible dynamic update, adaptive swaps; outputs stay exact."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import load_reference
from test_engine import reference_greedy

from tiermoe.config import DynamicPlacementConfig, PlacementConfig
from tiermoe.engine.dynamic import enable_dynamic_placement
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.copier import AsyncCopier, plain_copy
from tiermoe.placement.adaptive_policy import AdaptivePolicy, AdaptiveSettings
from tiermoe.placement.pass_cost import expert_cost_model
from tiermoe.placement.policies import KTDynamicPolicy

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(5, 30)), [40, 41, 42], list(range(60, 75))]


def eager_adaptive():
    """Settings that swap at the first sign of a difference, so a short test sees many swaps."""
    return DynamicPlacementConfig(policy="adaptive", adaptive=AdaptiveSettings(
        half_life_tokens=8, replan_every=1, margin=0.0, max_swaps_in_flight=2))


@pytest.mark.exactness
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_outputs_stay_exact_while_experts_move(arch, tiny_dir):
    path = tiny_dir(arch)
    ref = load_reference(path)
    with LLM(path, placement=PlacementConfig(num_gpu_experts=3), dtype=torch.float32, progress=False) as llm:
        manager = enable_dynamic_placement(llm.engine, eager_adaptive())
        before = llm.placement.clone()
        outs = llm.generate(PROMPTS, GREEDY)
        manager.drain()
        assert manager.copies_landed > 0 and not torch.equal(before, llm.placement)
        assert int(llm.placement.sum()) == int(before.sum())  # swaps keep the GPU budget (a slot may change layer)
        for prompt, out in zip(PROMPTS, outs):
            assert out.token_ids == reference_greedy(ref, prompt, 12)
        manager.close()


def test_layerwise_prefill_runs_cpu_experts_on_the_gpu_device_exactly(tiny_dir):
    path = tiny_dir("qwen2_moe")
    ref = load_reference(path)
    with LLM(path, placement=PlacementConfig(num_gpu_experts=2), dtype=torch.float32, progress=False) as llm:
        enable_dynamic_placement(llm.engine, DynamicPlacementConfig(prefill_threshold=10, prefill_buffer_gb=1e-6))
        calls = []
        for block in llm.hybrid.blocks.values():
            compute = block.cpu_tier._compute
            block.cpu_tier._compute = lambda x, i, w, c=compute: (calls.append(x.shape[0]), c(x, i, w))[1]
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        streamer = next(iter(llm.hybrid.blocks.values())).prefill_streamer
        assert streamer.batches == len(llm.hybrid.blocks)  # the 25-token prefill took the layerwise path
        assert streamer.chunk == 1  # a tiny buffer: one expert per buffer, so chunks really stream
        assert calls and max(calls) < 10  # the CPU backend only saw the decode passes
        assert out.token_ids == reference_greedy(ref, PROMPTS[0], 12)


def test_kt_dynamic_update_keeps_the_batch_most_used_experts(tiny_dir):
    path = tiny_dir("olmoe")
    with LLM(path, placement=PlacementConfig(num_gpu_experts=3), dtype=torch.float32, progress=False) as llm:
        config = DynamicPlacementConfig(policy="kt-dynamic", prefill_threshold=20)
        manager = enable_dynamic_placement(llm.engine, config)
        seen = {}
        for layer, block in llm.hybrid.blocks.items():
            router = block._modules["gate"]
            router.register_forward_hook(
                lambda m, i, o, layer=layer: [seen.setdefault(layer, torch.bincount(o[2].flatten(), minlength=8))]
                and None)
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=1))
        manager.drain()
        for layer, counts in seen.items():
            expected = torch.zeros(8, dtype=torch.bool)
            expected[torch.sort(counts.double(), descending=True, stable=True).indices[:3]] = True
            assert torch.equal(llm.placement[layer], expected)


def test_dynamic_update_without_threshold_warns(tiny_dir):
    with LLM(tiny_dir("olmoe"), dtype=torch.float32, progress=False) as llm:
        with pytest.warns(UserWarning, match="never fires"):
            enable_dynamic_placement(llm.engine, DynamicPlacementConfig(policy="kt-dynamic"))


def test_a_slow_copy_never_stalls_decoding_and_the_mask_flips_only_when_it_lands(tiny_dir):
    gate = threading.Event()

    def slow_copy(weights, device, pin):
        gate.wait(timeout=30)  # the copy lands only when the test says so
        return plain_copy(weights, device, pin)

    path = tiny_dir("qwen3_moe")
    ref = load_reference(path)
    with LLM(path, placement=PlacementConfig(num_gpu_experts=3), dtype=torch.float32, progress=False) as llm:
        manager = enable_dynamic_placement(llm.engine, eager_adaptive(), copier=AsyncCopier(slow_copy))
        mask_at_start = llm.placement.clone()
        seq = llm.engine.add(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
        step_times = []
        while len(seq.output_ids) < 15:
            t = time.perf_counter()
            llm.engine.step()
            step_times.append(time.perf_counter() - t)
        assert manager.in_flight, "the policy should have started swaps"
        assert torch.equal(llm.placement, mask_at_start)  # nothing flipped while the copies hang
        assert max(step_times) < 5.0  # steps kept going (a hung copy would block for 30 s)
        gate.set()
        llm.engine.run_to_completion()
        manager.drain()
        assert not torch.equal(llm.placement, mask_at_start)
        assert seq.output_ids == reference_greedy(ref, PROMPTS[0], 30)
        manager.close()


def _feed(policy, shares, passes, tokens=4, seed=0):
    """Passes of `tokens` tokens, top-1 routing drawn from `shares` (one layer)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(passes):
        ids = torch.multinomial(torch.tensor(shares, dtype=torch.float64), tokens, replacement=True, generator=gen)
        policy.observe(torch.bincount(ids, minlength=len(shares))[None], tokens, False)


def test_adaptive_policy_swaps_only_on_a_shift_the_evidence_shows():
    cost = expert_cost_model(1 << 20, 0.0)
    settings = AdaptiveSettings(half_life_tokens=400, horizon_tokens=100, margin=2.0)
    mask = torch.tensor([[True, True, False, False]])
    idle = torch.zeros(1, 4, dtype=torch.bool)
    calm = AdaptivePolicy(1, 4, cost, settings, torch.ones(1, 4))  # the workload matches its calibration
    proposed = 0
    for seed in range(200):  # noise alone never moves an expert, at any point
        _feed(calm, [0.25] * 4, passes=1, seed=seed)
        proposed += len(calm.propose(mask, idle))
    assert proposed == 0 and calm.recent_weight < 0.05
    shifted = AdaptivePolicy(1, 4, cost, settings, torch.ones(1, 4))
    _feed(shifted, [0.05, 0.2, 0.05, 0.7], passes=100)
    rates = shifted.lasting_rates()[0]
    assert rates[3] > 0.6 and rates[0] < 0.1  # the served workload, not the calibration, once it plainly differs
    swaps = shifted.propose(mask, idle)
    assert [(s.expert_in, s.expert_out) for s in swaps] == [(3, 0)]  # 2 vs 0 is a near-tie: not worth copies
    assert shifted.propose(mask, torch.tensor([[True, False, False, True]])) == []  # in flight: left alone


def test_adaptive_values_an_expert_by_the_step_time_its_move_saves():
    rates = torch.tensor([[0.9, 0.5, 0.4, 0.2]], dtype=torch.float64)
    on_cpu = torch.zeros(1, 4, dtype=torch.bool)  # the CPU tier is the layer's bottleneck: what it saves is its time
    reads_only = expert_cost_model(1 << 20, 0.0)  # no per-pair cost: an expert costs its read
    policy = AdaptivePolicy(1, 4, reads_only, AdaptiveSettings())
    policy.observe(torch.tensor([[64, 64, 64, 64]]), 128, False)  # every expert touched
    promote, demote = policy.swap_values(rates, on_cpu)
    # a pass reads a touched expert once, however many of its tokens route to it: hot and warm save the same
    assert abs(float(promote[0, 0] - promote[0, 1])) < 1e-3 * float(promote[0, 0])
    assert float(demote.abs().sum()) == 0.0  # nothing on the GPU tier to demote
    small = AdaptivePolicy(1, 4, reads_only, AdaptiveSettings())
    small.observe(torch.tensor([[1, 0, 1, 0]]), 1, False)  # one-token decode: the saving is the touch rate
    one = torch.ones((), dtype=torch.float64)
    # the GPU tier's own work hides behind the CPU tier's in all but the passes that leave the CPU tier idle
    read = reads_only.expert_seconds(False, one, 0 * one)
    assert torch.allclose(small.swap_values(rates, on_cpu)[0], rates * read, rtol=0.02)
    # with math per routed pair (2 flops per weight), a one-token pass saves the touch rate x (read + math)
    model = expert_cost_model(1 << 20, 2.0 * (1 << 19))
    with_math = AdaptivePolicy(1, 4, model, AdaptiveSettings())
    with_math.observe(torch.tensor([[1, 0, 1, 0]]), 1, False)
    per_touch = model.expert_seconds(False, one, one)
    assert torch.allclose(with_math.swap_values(rates, on_cpu)[0], rates * per_touch, rtol=0.02)
    assert float(per_touch) > float(read)


def test_kt_policy_ignores_decode_and_small_batches():
    policy = KTDynamicPolicy(threshold=50)
    mask = torch.tensor([[True, False, False]])
    policy.observe(torch.tensor([[0, 0, 9]]), 10, True)
    policy.observe(torch.tensor([[0, 0, 90]]), 100, False)
    assert policy.propose(mask, torch.zeros(1, 3, dtype=torch.bool)) == []
    policy.observe(torch.tensor([[0, 5, 90]]), 100, True)
    assert [(s.expert_in, s.expert_out) for s in policy.propose(mask, torch.zeros(1, 3, dtype=torch.bool))] == [(2, 0)]
