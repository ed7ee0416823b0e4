"""The slotted GPU tier: stacked expert slots computed with grouped GEMMs give what expert-by-expert computing
gives (fp32 exactly up to summation order, bf16 within its rounding), through swaps that reuse, grow and trim the
slots, with biases (GPT-OSS) and without, and on the expert-by-expert fallback."""

from __future__ import annotations

import pytest
import torch

from tiermoe.experts.ffn import ExpertActivation, routed_experts_forward
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


@pytest.mark.parametrize("bias,act", [(False, SILU), (True, GPT_OSS)])
def test_grouped_slots_equal_expert_by_expert_through_swaps(bias, act):
    gen = torch.Generator().manual_seed(0)
    weights = experts(bias, gen)
    tier = SlottedExpertSet("cpu", act, E)
    tier.reserve(3)
    held = {1, 4, 6}
    for e in sorted(held):
        tier.add(e, weights[e])
    assert tier.nbytes == 3 * weights[0].nbytes and tier._grouped_mm_runs(torch.float32)

    def check():
        x, ids, w = routing(held, gen)
        want = routed_experts_forward({e: weights[e] for e in held}, x, ids, w, act)
        assert torch.allclose(tier.forward(x, ids, w), want, rtol=1e-5, atol=1e-6)

    check()
    tier.pop(4), held.remove(4)  # a swap: the freed slot takes the next expert in, no new memory
    tier.add(7, weights[7]), held.add(7)
    assert tier.nbytes == 3 * weights[0].nbytes
    check()
    tier.add(0, weights[0]), held.add(0)  # more experts than slots: the stacks grow, the views follow
    assert tier.nbytes == 4 * weights[0].nbytes and torch.equal(tier.get(1).down, weights[1].down)
    check()
    tier.pop(1), held.remove(1)
    assert tier.trim() == weights[0].nbytes and tier.nbytes == 3 * weights[0].nbytes
    check()
    assert sorted(tier.slot_E.ge(0).nonzero().flatten().tolist()) == sorted(held)


def test_bf16_and_the_fallback_for_activations_of_another_dtype():
    gen = torch.Generator().manual_seed(1)
    weights = {e: ExpertWeights(*(t.to(torch.bfloat16) for t in w.tensors())) for e, w in experts(False, gen).items()}
    tier = SlottedExpertSet("cpu", SILU, E)
    for e in range(E):
        tier.add(e, weights[e])
    x, ids, w = routing(set(range(E)), gen)
    x = x.to(torch.bfloat16)
    want = routed_experts_forward(weights, x, ids, w.to(torch.bfloat16), SILU)
    got = tier.forward(x, ids, w.to(torch.bfloat16))
    assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()
    assert not tier._grouped_mm_runs(torch.float32)  # fp32 activations on bf16 stacks: expert by expert
    with pytest.raises(RuntimeError):
        tier.forward(x.float(), ids, w)  # as F.linear refuses mixed dtypes


def test_an_empty_tier_and_ids_of_no_expert_here_give_zeros():
    tier = SlottedExpertSet("cpu", SILU, E)
    x = torch.randn(T, D)
    assert torch.equal(tier.forward(x, torch.full((T, K), -1), torch.rand(T, K)), torch.zeros(T, D))
    tier.add(2, experts(False, torch.Generator().manual_seed(2))[2])
    assert torch.equal(tier.forward(x, torch.full((T, K), -1), torch.rand(T, K)), torch.zeros(T, D))
