"""The engine's capacity is shared fairly (issue: serving under hostile load): a step's prefill budget (a new short
prompt is not held behind a long one, the long one still advances, the budget is used whole; a scored prompt feeds
what the decode rows leave of a step's rows of logits, at least a floor), and the running slots (a request with none
running gets one from a batch holding more than its share)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tiermoe.engine.fair_share import (
    SCORED_ROWS_FLOOR,
    request_over_share,
    scored_rows_budget,
    share_prefill_budget,
)
from tiermoe.engine.llm import LLM
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


@pytest.mark.parametrize("running, waiting, max_running, over", [
    ({"batch": 4}, ["batch", "lone"], 4, "batch"),  # a newcomer, the batch over its share of 2
    ({"batch": 2, "a": 1, "b": 1}, ["lone"], 4, "batch"),  # share 1: the batch holds 2
    ({"a": 2, "b": 2}, ["lone"], 4, "a"),  # share 1 (4 slots, 3 requests): the first of the biggest gives
    ({"batch": 4}, ["batch"], 4, None),  # nobody else waits
    ({"a": 1, "b": 1, "c": 1, "d": 1}, ["e"], 4, None),  # everyone at its share: the newcomer waits its turn
])
def test_a_request_over_its_share_gives_a_slot_to_a_newcomer(running, waiting, max_running, over):
    assert request_over_share(Counter(running), waiting, max_running) == over


def test_a_lone_request_starts_beside_a_batch_holding_every_slot_and_both_stay_exact(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, max_running=4, prefill_chunk=16, progress=False) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        batch = [engine.add([5 + i, 6, 7], params, group=1) for i in range(6)]
        for _ in range(3):
            engine.step()
        assert sum(s in engine.running for s in batch) == 4
        lone = engine.add([9, 10, 11], SamplingParams(max_tokens=3, ignore_eos=True), group=2)
        engine.step()
        # on the parent the lone request waited for a batch sequence to finish (9 more steps)
        assert lone in engine.running and len(lone.output_ids) == 1
        while engine.has_work():
            engine.step()
        assert engine.preemptions >= 1
        alone = llm.generate([[5 + i, 6, 7] for i in range(6)] + [[9, 10, 11]], params)
        assert [s.output_ids for s in batch] == [out.token_ids for out in alone[:6]]
        assert lone.output_ids == alone[6].token_ids[:3]


@pytest.mark.parametrize("decode_rows, max_running, rows", [
    (0, 32, 32),  # nothing else runs: a whole batch of rows
    (20, 32, 12),
    (31, 32, SCORED_ROWS_FLOOR),  # the decode rows leave one: the floor
    (0, 4, SCORED_ROWS_FLOOR),
])
def test_scored_rows_are_what_the_decode_rows_leave_of_a_full_batch_at_least_the_floor(decode_rows, max_running,
                                                                                       rows):
    assert scored_rows_budget(decode_rows, max_running) == rows


def _scored_rows_per_step(engine, prompt: list[int]) -> tuple[list[int], list]:
    scored = engine.add(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    fed = []
    while scored.prefilling:
        before = scored.num_fed
        engine.step()
        fed.append(scored.num_fed - before)
    while engine.has_work():
        engine.step()
    return fed, scored.prompt_logprobs


def test_a_scored_prompt_feeds_the_rows_decodes_leave_and_scores_the_same(tiny_dir):
    prompt = list(range(3, 60))
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, max_running=12, prefill_chunk=64, progress=False) as llm:
        engine = llm.engine
        alone, scores_alone = _scored_rows_per_step(engine, prompt)
        # on the parent: 16 rows a step (SCORED_ROWS_PER_STEP) whatever else ran
        assert alone[:-1] == [12] * (len(alone) - 1)  # no decode rows: a whole batch of rows a step
        decoding = [engine.add([5 + i, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(10)]
        engine.step()  # their prompts: from now on 10 decode rows a step
        beside, scores_beside = _scored_rows_per_step(engine, prompt)
        assert beside[:-1] == [SCORED_ROWS_FLOOR] * (len(beside) - 1) and sum(beside) == len(prompt)
        assert all(len(seq.output_ids) == 30 for seq in decoding)
    # the same positions scored alike (other rows in the step change the products' summation order only)
    assert [[i for i, _ in s.top] for s in scores_beside] == [[i for i, _ in s.top] for s in scores_alone]
    assert [s.logprob for s in scores_beside] == pytest.approx([s.logprob for s in scores_alone], abs=1e-5)
