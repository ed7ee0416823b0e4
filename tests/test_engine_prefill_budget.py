"""A step's prefill budget is shared fairly (issue: serving under hostile load, class 3): a new short prompt is not
held behind a long one, the long one still advances, and the budget is used whole."""

from __future__ import annotations

import random

import pytest
import torch

from tiermoe.engine.llm import LLM
from tiermoe.engine.prefill_budget import share_prefill_budget
from tiermoe.engine.sampling import SamplingParams


@pytest.mark.parametrize("needs, budget, shares", [
    ([8000, 20], 512, [492, 20]),  # the short prompt whole, the rest to the long one
    ([8000, 8000], 512, [256, 256]),
    ([8000, 8000, 8000], 512, [171, 171, 170]),  # the odd token to the oldest
    ([3, 2], 512, [3, 2]),
    ([100, 1, 1000], 10, [5, 1, 4]),
    ([], 512, []),
])
def test_shares_are_max_min_fair_and_use_the_budget(needs, budget, shares):
    got = share_prefill_budget(needs, budget)
    assert got == shares
    assert sum(got) == min(budget, sum(needs)) and all(0 <= g <= n for g, n in zip(got, needs))


def test_any_needs_get_shares_within_one_token_of_each_other():
    rng = random.Random(0)
    for _ in range(2000):
        needs = [rng.randint(1, 50) for _ in range(rng.randint(1, 6))]
        budget = rng.randint(1, 120)
        shares = share_prefill_budget(needs, budget)
        assert sum(shares) == min(budget, sum(needs)) and all(0 <= s <= n for s, n in zip(shares, needs))
        unmet = [s for s, n in zip(shares, needs) if s < n]
        assert not unmet or max(unmet) - min(unmet) <= 1 and min(shares) >= min(min(unmet), min(needs))


def test_a_new_short_prompt_is_not_held_behind_a_long_one(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, prefill_chunk=8, progress=False) as llm:
        engine = llm.engine
        long_prompt = engine.add(list(range(3, 200)), SamplingParams(max_tokens=2, ignore_eos=True))
        engine.step()
        short = engine.add([5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
        fed_before = long_prompt.num_fed
        engine.step()
        # on the parent the long prompt took every step's whole budget: the short one's token came 24 steps later
        assert short.output_ids and long_prompt.num_fed - fed_before == 5
        while engine.has_work():
            engine.step()
        alone = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        assert short.output_ids == alone.token_ids
