"""The slotted GPU tier: layers' experts in slots of one pool, computed with grouped GEMMs over each layer's window,
give what expert-by-expert computing gives (fp32 up to summation order, bf16 within its rounding), through
swaps inside a layer and between layers (a slot handed over, no memory added), a pool that grows when it must,
with biases (GPT-OSS) and without, by torch's grouped GEMM and by the Triton one, and on the expert-by-expert
fallback."""

from __future__ import annotations

import pytest
import torch

from tiermoe.experts import triton_grouped
from tiermoe.experts.ffn import ExpertActivation, routed_experts_forward
from tiermoe.experts.slot_pool import ExpertSlotPool
from tiermoe.experts.slotted_tier import SlottedExpertSet
from tiermoe.experts.weights import ExpertWeights

E, D, I, T, K = 8, 32, 16, 7, 3
SILU = ExpertActivation("silu_glu")
GPT_OSS = ExpertActivation("gpt_oss_glu")


def experts(bias: bool, gen: torch.Generator) -> dict[int, ExpertWeights]:
    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    return {e: ExpertWeights(rand(2 * I, D), rand(D, I), rand(2 * I) if bias else None, rand(D) if bias else None)
            for e in range(E)}


def routing(held: set[int], gen: torch.Generator):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    ids = ids.masked_fill(~torch.isin(ids, torch.tensor(sorted(held))), -1)  # another tier's pairs: -1
    return torch.randn(T, D, generator=gen), ids, torch.rand(T, K, generator=gen)


# grouped_mm: torch's grouped GEMM (what the CPU device takes); triton: the kernel CUDA devices without a sync-free
# torch._grouped_mm get, here under Triton's interpreter
KERNELS = ["grouped_mm"] + (["triton"] if triton_grouped.available() else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias,act", [(False, SILU), (True, GPT_OSS)])
def test_grouped_slots_equal_expert_by_expert_through_swaps_within_and_between_layers(bias, act, kernel):
    gen = torch.Generator().manual_seed(0)
    weights = experts(bias, gen)
    pool = ExpertSlotPool("cpu", kernel=None if kernel == "grouped_mm" else kernel)
    tiers = [SlottedExpertSet(act, E, pool) for _ in range(3)]
    held = [{1, 4, 6}, {0, 2}, {3, 5, 7}]
    for tier, experts_here in zip(tiers, held):
        pool.reserve(len(experts_here))
    for tier, experts_here in zip(tiers, held):
        for e in sorted(experts_here):
            tier.add(e, weights[e])
    per_expert = weights[0].nbytes
    assert pool.nbytes == 8 * per_expert and pool.kernel(torch.float32).name == kernel

    def check():
        for tier, experts_here in zip(tiers, held):
            x, ids, w = routing(experts_here, gen)
            want = routed_experts_forward({e: weights[e] for e in experts_here}, x, ids, w, act)
            got = tier.forward(x, ids, w)  # fp32 up to summation order: the measure, max error / max value
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
            assert sorted(tier.slot_E.ge(0).nonzero().flatten().tolist()) == sorted(experts_here)

    check()
    tiers[0].pop(4), held[0].remove(4)  # a swap in layer 0: its freed slot takes the next expert in
    tiers[0].add(7, weights[7]), held[0].add(7)
    check()
    tiers[1].pop(2), held[1].remove(2)  # between layers: layer 1's slot goes to layer 2, no memory added
    tiers[2].add(0, weights[0]), held[2].add(0)
    assert pool.nbytes == 8 * per_expert and pool.free_slots == 0
    check()  # layer 2's window now spans layer 1's slots: empty groups there
    tiers[1].add(6, weights[6]), held[1].add(6)  # more experts than the pool was sized for: it grows
    assert pool.nbytes == 9 * per_expert and torch.equal(tiers[0].get(1).down, weights[1].down)
    check()


def test_bf16_and_the_fallback_for_activations_of_another_dtype():
    gen = torch.Generator().manual_seed(1)
    weights = {e: ExpertWeights(*(t.to(torch.bfloat16) for t in w.tensors())) for e, w in experts(False, gen).items()}
    tier = SlottedExpertSet(SILU, E, ExpertSlotPool("cpu"))
    for e in range(E):
        tier.add(e, weights[e])
    x, ids, w = routing(set(range(E)), gen)
    x = x.to(torch.bfloat16)
    want = routed_experts_forward(weights, x, ids, w.to(torch.bfloat16), SILU)
    got = tier.forward(x, ids, w.to(torch.bfloat16))
    assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()
    assert tier.pool.kernel(torch.float32).name == "per_expert"  # fp32 activations on bf16 stacks
    with pytest.raises(RuntimeError):
        tier.forward(x.float(), ids, w)  # as F.linear refuses mixed dtypes


def test_an_empty_tier_and_ids_of_no_expert_here_give_zeros():
    tier = SlottedExpertSet(SILU, E, ExpertSlotPool("cpu"))
    x = torch.randn(T, D)
    assert torch.equal(tier.forward(x, torch.full((T, K), -1), torch.rand(T, K)), torch.zeros(T, D))
    tier.add(2, experts(False, torch.Generator().manual_seed(2))[2])
    assert torch.equal(tier.forward(x, torch.full((T, K), -1), torch.rand(T, K)), torch.zeros(T, D))
