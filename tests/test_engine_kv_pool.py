"""The KV pool and the ragged step: one forward for every sequence of a step gives each what transformers gives it.

fp32 tolerance: rel_err (max |a - b| / max |b|) <= 1e-5 against the unmodified transformers model's full forward
(observed <= 2e-6: padded decode batches and GEMMs of many rows sum in another order than one sequence alone;
Qwen3-Next's one-token recurrence itself differs from its chunked form by ~1e-5, as in transformers).
"""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, load_reference, make_mask, rel_err

from tiermoe.arch import detect, load_config
from tiermoe.engine.kv_pool import KVPool
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.layers.ragged_step import RaggedStep, SeqFeed, decode_runs
from tiermoe.layers.triton_paged_attention import TritonPagedAttention
from tiermoe.testing.pool_exactness import (
    CHUNK,
    DECODE_STEPS,
    PROMPT_LENGTHS,
    eight_sequences_against,
)

FP32_TOL = 2e-5


@pytest.mark.exactness
@pytest.mark.parametrize("arch", ARCHS)
def test_eight_sequences_in_one_forward_per_step_equal_transformers(arch, tiny_dir):
    path = tiny_dir(arch)
    mask = make_mask("random_half", detect(load_config(path)))
    with LLM(path, placement=mask, dtype=torch.float32, max_running=8, page_size=4, progress=False) as llm:
        result = eight_sequences_against(llm, load_reference(path))
    # the longest prompt's chunks, then its decodes: one forward each for all eight
    assert result.forwards == -(-max(PROMPT_LENGTHS) // CHUNK) + DECODE_STEPS
    assert result.worst_rel_err <= FP32_TOL and result.tokens_equal, (arch, result)
    assert result.pages_left == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_eight_sequences_on_the_cuda_attention_path_equal_transformers(arch, tiny_dir):
    """The CUDA path's attention, run here: decode rows read the pool in place through the Triton kernel (under
    its interpreter), prompt chunks and linear-attention states gathered, as on a GPU."""
    path = tiny_dir(arch)
    mask = make_mask("random_half", detect(load_config(path)))
    # a pool of 512 tokens: the interpreter copies every tensor a launch takes, the pool's slots included
    with LLM(path, placement=mask, dtype=torch.float32, max_running=8, page_size=4, max_total_tokens=512,
             progress=False, attention_backend="triton") as llm:
        assert isinstance(llm.engine.decode_attention, TritonPagedAttention)
        result = eight_sequences_against(llm, load_reference(path))
    assert result.worst_rel_err <= 1e-5 and result.tokens_equal, (arch, result)
    assert result.pages_left == 0


def _visible(mask) -> list:
    return (mask == 0).tolist()


def test_a_step_reads_each_sequences_visible_pages_and_writes_its_new_slots():
    # page size 4; sequence A: 12 tokens in the pool, decodes 1; sequence B: new, a chunk of 3
    feeds = [SeqFeed(12, 1, {None: [2, 5, 6, 8], 8: [-1, 7, 9, 10]}), SeqFeed(0, 3, {None: [1], 8: [3]})]
    step = RaggedStep(feeds, 4, {0: None, 1: 8}, torch.device("cpu"), torch.float32)
    assert step.position_ids.tolist() == [[12, 0, 1, 2]]
    full, sliding = step.groups[None], step.groups[8]
    assert full.write_index.tolist() == [32, 4, 5, 6]  # slot = page * 4 + offset
    assert full.read_pages.tolist() == [2, 5, 6, 8, 1]  # A's 4 pages, then B's 1
    (a, b) = full.parts
    assert (a.first, a.end, b.first, b.end) == (0, 4, 4, 5)
    assert _visible(a.mask[0, 0]) == [[True] * 13 + [False] * 3]  # positions 13-15 of A's last page: not yet
    assert _visible(b.mask[0, 0]) == [[True, False, False, False], [True, True, False, False],
                                      [True, True, True, False]]
    # window 8: A's query at 12 sees positions 5..12 only (> 12 - 8): pages 1-3, never its freed page 0
    assert sliding.write_index.tolist() == [40, 12, 13, 14]
    assert sliding.read_pages.tolist() == [7, 9, 10, 3]
    assert _visible(sliding.parts[0].mask[0, 0]) == [[False] + [True] * 8 + [False] * 3]
    with pytest.raises(ValueError, match="freed"):  # a visible position on a page handed back
        RaggedStep([SeqFeed(6, 1, {8: [-1, 7]})], 4, {0: 8}, torch.device("cpu"), torch.float32)
    # attending in place: A's table with its freed page (before the window, never read) as the zero page
    in_place = RaggedStep(feeds, 4, {0: None, 1: 8}, torch.device("cpu"), torch.float32, decode_attention=object())
    assert in_place.groups[8].decode.tables.tolist() == [[0, 7, 9, 10]]
    assert in_place.groups[8].decode.lo.tolist() == [5] and in_place.groups[8].write_index.tolist() == [40, 12, 13, 14]
    with pytest.raises(ValueError, match="freed"):
        RaggedStep([SeqFeed(6, 1, {8: [-1, 7]})], 4, {0: 8}, torch.device("cpu"), torch.float32,
                   decode_attention=object())


def test_decode_rows_of_similar_lengths_attend_together_padded_with_the_zero_page():
    assert decode_runs([2000, 1500, 1000, 512, 256, 128, 64, 16]) == [(0, 3), (3, 5), (5, 8)]
    feeds = [SeqFeed(5, 1, {None: [3, 4]}), SeqFeed(1, 1, {None: [6]})]
    step = RaggedStep(feeds, 4, {0: None}, torch.device("cpu"), torch.float32)
    group = step.groups[None]
    assert len(step.row_parts) == 1 and group.read_pages.tolist() == [3, 4, 6, 0]
    assert _visible(group.parts[0].mask[:, 0, 0]) == [[True] * 6 + [False] * 2, [True, True] + [False] * 6]


def test_sliding_groups_keep_only_the_window_and_pages_come_back():
    pool = KVPool({0: None, 1: 8}, tokens=64, max_sequences=2, device=torch.device("cpu"), page_size=4,
                  max_chunk=8)
    share = pool.new_share()
    assert pool.reserve(share, 0, 20)
    assert [len(t) for t in share.tables.values()] == [5, 5]
    pool.trim(share, 20)  # the next query (position 20) sees 13..20: pages 0-2 of the window group go back
    assert share.tables[8][:3] == [-1, -1, -1] and all(p > 0 for p in share.tables[8][3:])
    assert pool.used_pages() == {None: 5, 8: 2}
    assert not pool.reserve(share, 20, 20 + 4 * 64)  # more than the pool: nothing taken
    assert pool.used_pages() == {None: 5, 8: 2}
    pool.release(share)
    assert pool.used_pages() == {None: 0, 8: 0}


def test_pages_never_written_cannot_poison_attention(tiny_dir):
    # attention reads whole pages and masks what it must not see; a masked slot holding NaN (never-written memory)
    # would still give 0 x NaN: a page is zeroed when first handed out
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21, 22]]
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, page_size=4, max_total_tokens=64, prefix_cache=False,
             progress=False) as llm:
        want = [r.token_ids for r in llm.generate(prompts, greedy)]
        pages = llm.engine.pool.pages
        with torch.inference_mode():
            for pair in pages._slots.values():
                for t in pair:
                    for page in set(range(1, pages.num_pages[None] + 1)) - pages._prepared[None]:
                        t[page * 4:(page + 1) * 4] = float("nan")
        assert [r.token_ids for r in llm.generate(prompts, greedy)] == want


def test_a_follower_pool_zeroes_the_pages_rank_0_hands_out_before_they_are_written(tiny_dir):
    # a follower rank's pool never hands pages out (rank 0's tables arrive with each step), so it must zero a page
    # itself the first time a step writes there: else a masked slot of a partly written page holds whatever
    # memory it got (here NaN), and 0 x NaN poisons the step
    prompt = [5, 6, 7, 8, 9, 10]
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, page_size=4, max_total_tokens=64, prefix_cache=False,
             progress=False) as llm:
        engine = llm.engine
        seq = engine.new_sequence()
        want = engine.feed([seq], [prompt], rows=["all"])[0]
        engine.release(seq)
        follower = LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, page_size=4, max_total_tokens=64,
                       prefix_cache=False, progress=False)
    with follower:
        engine = follower.engine
        engine.forward_feeds([SeqFeed(0, 1, {None: [1]})], [[3]])  # the layers reserve their slots
        pages = engine.pool.pages
        with torch.inference_mode():
            for pair in pages._slots.values():
                for t in pair:
                    t[2 * 4:] = float("nan")  # every page from 2 on: never handed out by this pool
        got = engine.forward_feeds([SeqFeed(0, len(prompt), {None: [5, 9]})], [prompt], ["all"])[0]
        assert rel_err(got, want) <= FP32_TOL


def test_feeding_past_the_models_context_is_one_clear_error_and_takes_no_page(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), max_running=1, progress=False) as llm:
        engine = llm.engine
        context = engine.max_context
        seq = engine.new_sequence()
        for start in range(0, context - 1, 64):  # chunks a step holds
            engine.feed([seq], [[5] * min(64, context - 1 - start)], rows=["none"])
        free = engine.pool.free_pages()
        with pytest.raises(TiermoeError, match=rf"would hold {context + 1} tokens; the model's context is {context}"):
            engine.feed([seq], [[5, 6]])
        assert engine.pool.free_pages() == free and seq.num_fed == context - 1
        engine.feed([seq], [[5]])  # the last position still fits
        engine.release(seq)
