"""Cross-layer placement: a GPU slot of a cold layer goes to a hot expert of another layer, the total GPU budget
kept at every moment (the engine demotes in one layer before it promotes in the other), outputs exact."""

from __future__ import annotations

import torch
from conftest import load_reference
from test_engine import reference_greedy

from tiermoe.config import PlacementConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.placement_manager import PlacementManager
from tiermoe.engine.sampling import SamplingParams
from tiermoe.placement.adaptive_policy import AdaptivePolicy, AdaptiveSettings
from tiermoe.placement.pass_cost import expert_cost_model
from tiermoe.placement.policies import Swap
from tiermoe.placement.profiles import GPUProfile
from tiermoe.placement.tier_time import TierFit

PROMPTS = [list(range(5, 30)), [40, 41, 42]]


def _serve(policy, passes: int) -> None:
    """Layer 0 routes 90% to its GPU expert 0 and 10% to CPU expert 2 (GPU expert 1 idles); layer 1, which has no
    GPU expert, routes every token to expert 3. One token a pass, top-1."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(passes):
        counts = torch.zeros(2, 4, dtype=torch.int64)
        counts[0, 0 if torch.rand((), generator=gen) < 0.9 else 2] = 1
        counts[1, 3] = 1
        policy.observe(counts, 1, False)


def test_a_cold_layers_gpu_slot_goes_to_a_hot_expert_of_another_layer():
    cost = expert_cost_model(1 << 20, 0.0)
    prior = torch.tensor([[10.0, 9.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]])  # frequency's top-2 are both in layer 0
    mask = torch.tensor([[True, True, False, False], [False, False, False, False]])
    idle = torch.zeros(2, 4, dtype=torch.bool)
    cross = AdaptivePolicy(2, 4, cost, AdaptiveSettings(cross_layer=True), prior)
    within = AdaptivePolicy(2, 4, cost, AdaptiveSettings(cross_layer=False), prior)
    for policy in (cross, within):
        _serve(policy, 300)
    swaps = cross.propose(mask, idle)
    assert swaps[0] == Swap(1, 3, 1, layer_out=0)  # the idle slot of layer 0 serves layer 1's hot expert
    assert all(s.out_layer == s.layer or s.layer_out is not None for s in swaps)
    after = mask.clone()
    for s in swaps:
        after[s.layer, s.expert_in], after[s.out_layer, s.expert_out] = True, False
    assert int(after.sum()) == int(mask.sum())  # the total budget stays
    assert all(s.layer_out is None and s.layer == 0 for s in within.propose(mask, idle))  # layer 1 gets nothing


def test_where_the_gpu_tier_is_slower_a_swap_moves_routed_pairs_off_it():
    # the GPU tier on a CPU (--gpu-profile this-cpu): an expert costs it ten times the CPU tier's time, so a layer
    # that holds its hot expert there waits for the GPU tier, and the swap that pays demotes that expert for an
    # idle one (the old per-expert valuation, never below 0, kept such a placement as it was)
    slow_gpu = GPUProfile("slow", memory_bandwidth=1e9, compute_flops=1e10, pcie_bandwidth=1e10, launch_overhead=1e-5)
    fast_cpu = TierFit(1e-4, 1e-6, 0.0, 0.0, 0)
    cost = expert_cost_model(1 << 20, 2e6, gpu=slow_gpu, cpu=fast_cpu)
    prior = torch.tensor([[10.0, 9.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    mask = torch.tensor([[True, True, False, False], [False, False, False, False]])
    policy = AdaptivePolicy(2, 4, cost, AdaptiveSettings(cross_layer=True), prior)
    _serve(policy, 300)
    promote, demote = policy.swap_values(policy.rates(), mask)
    assert float(demote[0, 0]) < 0  # demoting layer 0's hot expert saves step time
    assert float(promote[1, 3]) < 0  # promoting layer 1's hot expert costs it: no slot goes there
    swaps = policy.propose(mask, torch.zeros(2, 4, dtype=torch.bool))
    assert swaps and swaps[0].out_layer == 0 and swaps[0].expert_out == 0
    assert swaps[0].layer == 0 and swaps[0].expert_in in (2, 3)  # a colder expert takes the slot


class OneSwap:
    """A policy that proposes one given swap after the first pass."""

    name = "scripted"

    def __init__(self, swap: Swap):
        self.swap, self.proposed = swap, False

    def observe(self, counts_LE, num_tokens, is_prefill) -> None:
        pass

    def propose(self, mask_LE, busy_LE) -> list[Swap]:
        if self.proposed:
            return []
        self.proposed = True
        return [self.swap]


def test_engine_demotes_in_one_layer_before_it_promotes_in_another_and_stays_exact(tiny_dir):
    path = tiny_dir("qwen3_moe")
    ref = load_reference(path)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(path, placement=PlacementConfig(num_gpu_experts=3), dtype=torch.float32, progress=False) as llm:
        hybrid = llm.hybrid
        before = llm.placement.clone()
        layers = [layer for layer in hybrid.blocks if before[layer].any()]
        cold, hot = layers[0], layers[-1]
        assert cold != hot
        demoted = int(before[cold].nonzero()[0])
        promoted = int((~before[hot]).nonzero()[0])
        budget = sum(b.gpu_tier.nbytes for b in hybrid.blocks.values())
        events, peaks = [], []
        for layer, block in hybrid.blocks.items():
            start, finish = block.start_move, block.finish_move

            def started(expert, to_gpu, copier, layer=layer, start=start):
                held = sum(b.gpu_tier.nbytes for b in hybrid.blocks.values())
                peaks.append(held + (hybrid.spec.bytes_per_expert(hybrid.expert_dtype) if to_gpu else 0))
                events.append(("start", layer, expert, to_gpu))
                return start(expert, to_gpu, copier)

            def finished(expert, to_gpu, landed, layer=layer, finish=finish):
                moved = finish(expert, to_gpu, landed)
                peaks.append(sum(b.gpu_tier.nbytes for b in hybrid.blocks.values()))
                events.append(("land", layer, expert, to_gpu))
                return moved

            block.start_move, block.finish_move = started, finished
        manager = PlacementManager(hybrid, OneSwap(Swap(hot, promoted, demoted, layer_out=cold)))
        llm.engine.add_recorder(manager)
        llm.engine.after_step_hooks.append(manager.after_step)
        outs = llm.generate(PROMPTS, greedy)
        manager.drain()
        assert events == [("start", cold, demoted, False), ("land", cold, demoted, False),
                          ("start", hot, promoted, True), ("land", hot, promoted, True)]
        assert max(peaks) <= budget  # the promotion's copy starts only once the demotion has freed its slot
        after = llm.placement
        assert not after[cold, demoted] and after[hot, promoted]
        assert int(after[cold].sum()) == int(before[cold].sum()) - 1
        assert int(after[hot].sum()) == int(before[hot].sum()) + 1
        assert int(after.sum()) == int(before.sum())
        for prompt, out in zip(PROMPTS, outs):
            assert out.token_ids == reference_greedy(ref, prompt, 8)
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == [reference_greedy(ref, p, 8) for p in PROMPTS]
        manager.close()
