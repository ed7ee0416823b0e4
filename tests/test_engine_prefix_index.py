"""Prefix reuse: a prompt that starts with pages already in the pool takes them instead of recomputing them."""

from __future__ import annotations

import logging

import pytest
import torch

from tiermoe.engine.llm import LLM
from tiermoe.engine.prefix_index import PrefixIndex, page_keys
from tiermoe.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
FIRST_TURN = [3 + (5 * i) % 200 for i in range(37)]


def _second_turn(first) -> list[int]:
    """A chat client's next request: the whole conversation again, then the new message."""
    return FIRST_TURN + first.token_ids + [7, 8, 9, 10, 11]


@pytest.mark.exactness
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_a_second_turn_reuses_the_first_turns_pages_and_gives_the_same_tokens(arch, tiny_dir):
    with LLM(tiny_dir(arch), dtype=torch.float32, page_size=4, prefix_cache=False, progress=False) as llm:
        first = llm.generate(FIRST_TURN, GREEDY)[0]
        want = llm.generate(_second_turn(first), GREEDY)[0].token_ids
        assert llm.engine.prefix_hit_tokens == 0
    with LLM(tiny_dir(arch), dtype=torch.float32, page_size=4, progress=False) as llm:
        first = llm.generate(FIRST_TURN, GREEDY)[0]
        fed_first = len(FIRST_TURN) + len(first.token_ids) - 1  # the last sampled token was never fed
        assert llm.engine.pool.cached_pages() == fed_first // 4
        second = llm.generate(_second_turn(first), GREEDY)[0]
        assert llm.engine.prefix_hit_tokens == fed_first // 4 * 4  # every full page of the first turn
        assert second.token_ids == want
        assert llm.engine.pool.used_pages() == {None: 0}


def test_a_prompt_that_asks_for_its_logprobs_computes_every_row(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, page_size=4, progress=False) as llm:
        llm.generate(FIRST_TURN, GREEDY)
        scored = llm.generate(FIRST_TURN, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        assert llm.engine.prefix_hit_tokens == 0 and len(scored.prompt_logprobs) == len(FIRST_TURN) - 1


@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_next"])
def test_reuse_is_off_with_a_log_line_for_sliding_windows_and_linear_attention(arch, tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tiermoe.engine.engine"):
        with LLM(tiny_dir(arch), dtype=torch.float32, page_size=4, progress=False) as llm:
            first = llm.generate(FIRST_TURN, GREEDY)[0]
            llm.generate(_second_turn(first), GREEDY)
            assert llm.engine.pool.prefix is None and llm.engine.prefix_hit_tokens == 0
    assert "prefix reuse is off for this model" in caplog.text


def test_the_pool_evicts_the_least_recently_used_cached_pages_when_it_needs_them(tiny_dir):
    with LLM(tiny_dir("olmoe"), dtype=torch.float32, page_size=4, max_total_tokens=48, progress=False) as llm:
        short = SamplingParams(max_tokens=1)
        prompts = [[10 + k] * 17 for k in range(4)]  # 5 pages each while it runs, 4 full ones kept; 12 in all
        for prompt in prompts:
            llm.generate(prompt, short)
        # the third prompt took the first one's oldest page, the fourth its other three and the second's first
        assert llm.engine.pool.cached_pages() == 11
        llm.generate(prompts[0], short)
        assert llm.engine.prefix_hit_tokens == 0
        llm.generate(prompts[3], short)
        assert llm.engine.prefix_hit_tokens == 16


def test_keys_chain_the_whole_prefix_and_shared_pages_are_counted():
    a, b = page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2), page_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert a[0] != b[0] and a[1] != b[1]  # the same second page after another first one is another key
    index = PrefixIndex()
    assert index.give_back(5, a[0]) and index.take(a[0]) == 5 and index.take(a[0]) == 5  # two holders
    assert index.give_back(5, a[0]) and index.evict() is None  # one still holds it
    assert not index.give_back(6, a[0])  # the same tokens in another page: that one is freed
    assert index.give_back(5, a[0]) and index.evict() == 5 and len(index) == 0
