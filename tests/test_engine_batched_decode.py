"""Batched decode: one model forward for all decoding sequences gives each one what its own forward gives.

fp32 tolerance: rel_err (max |a - b| / max |b|) <= 1e-5 for logits of a batched step against per-sequence forwards.
Observed on the tiny models: <= 6e-7 (fp32 GEMMs of B rows and padded attention sum in another order than one
row alone; a batch of one row is bit-identical).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHS, rel_err

import tiermoe.engine.engine as engine_module
from tiermoe.engine.batched_decode import (
    batched_decode_forward,
    decode_groups,
    left_pad_stack,
)
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams, new_generator
from tiermoe.engine.sequence import Sequence
from tiermoe.stats.pass_rows import row_table

FP32_TOL = 1e-5
# Sliding-window layers (GPT-OSS) and linear attention (Qwen3-Next) keep the per-sequence path.
PER_SEQUENCE = {"gpt_oss", "qwen3_next"}
BATCHED = [a for a in ARCHS if a not in PER_SEQUENCE]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33], [40]]
CPU = torch.device("cpu")


class _Seq:
    """Just what Engine._forward needs of a sequence: its cache."""

    def __init__(self, cache=None):
        self.cache = cache


def prefilled(engine, prompt: list[int]):
    seq = _Seq()
    engine._forward(seq, prompt)
    return seq.cache


def decode_together(engine, caches, tokens):
    with torch.inference_mode():
        return batched_decode_forward(engine.model, caches, tokens, CPU, engine._cache_kwarg)


def decode_alone(engine, cache, token):
    return engine._forward(_Seq(cache), [token])[-1]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decode_is_chosen_once_per_model_where_it_is_exact(arch, tiny_dir):
    with LLM(tiny_dir(arch), dtype=torch.float32, progress=False) as llm:
        assert llm.engine.batched_decode == (arch not in PER_SEQUENCE)


@pytest.mark.parametrize("arch", BATCHED)
def test_batched_step_logits_match_per_sequence_forwards(arch, tiny_dir):
    with LLM(tiny_dir(arch), dtype=torch.float32, progress=False) as llm:
        engine = llm.engine
        caches = [prefilled(engine, p) for p in PROMPTS]  # past lengths 7, 2, 4, 1: three rows padded
        alone_caches = copy.deepcopy(caches)
        tokens = [50, 51, 52, 53]
        for step in range(3):  # a few steps: the caches the batched step grew are right for the next one
            together = decode_together(engine, caches, tokens)
            alone = [decode_alone(engine, c, t) for c, t in zip(alone_caches, tokens)]
            for got, want in zip(together, alone):
                assert rel_err(got, want) <= FP32_TOL
            assert [c.get_seq_length() for c in caches] == [len(p) + step + 1 for p in PROMPTS]
            tokens = [int(x.argmax()) for x in alone]
        for got, want in zip(caches, alone_caches):  # each sequence's own cache holds its own K/V, unpadded
            for layer, ref in zip(got.layers, want.layers):
                assert layer.keys.shape == ref.keys.shape
                assert rel_err(layer.keys, ref.keys) <= FP32_TOL


def test_padding_does_not_change_a_row(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, progress=False) as llm:
        engine = llm.engine
        row = prefilled(engine, [5, 6, 7, 8, 9])
        shorter, longer = prefilled(engine, [9]), prefilled(engine, list(range(10, 40)))
        unpadded = decode_together(engine, [copy.deepcopy(row), shorter], [50, 60])[0]
        padded = decode_together(engine, [copy.deepcopy(row), longer], [50, 60])[0]  # 25 pads before the row
        alone = decode_alone(engine, copy.deepcopy(row), 50)
        assert rel_err(padded, alone) <= FP32_TOL and rel_err(unpadded, alone) <= FP32_TOL
        assert int(padded.argmax()) == int(unpadded.argmax()) == int(alone.argmax())
        # a batch of one row takes no padding and the same GEMM shapes: bit-identical to the plain forward
        assert torch.equal(decode_together(engine, [copy.deepcopy(row)], [50])[0], alone)


@pytest.mark.parametrize("arch", BATCHED)
def test_concurrent_greedy_equals_one_at_a_time_through_batched_steps(arch, tiny_dir):
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(tiny_dir(arch), dtype=torch.float32, prefill_chunk=3, progress=False) as llm:
        engine = llm.engine
        batched_rows = []
        original = engine._forward_decode
        engine._forward_decode = lambda seqs, tokens: (batched_rows.append(len(seqs)), original(seqs, tokens))[1]
        together = llm.generate(PROMPTS, greedy)
        assert max(batched_rows) == len(PROMPTS)  # the path under test ran, with every sequence in one forward
        for prompt, result in zip(PROMPTS, together):
            assert result.token_ids == llm.generate(prompt, greedy)[0].token_ids


def test_a_decode_step_is_one_model_forward(tiny_dir):
    with LLM(tiny_dir("olmoe"), dtype=torch.float32, progress=False) as llm:
        engine = llm.engine
        seqs = [engine.add(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in PROMPTS]
        engine.step()  # all four prompts prefill (four forwards, MoE blocks shared)
        forwards = []
        hook = llm.hybrid.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
        try:
            produced = engine.step()
        finally:
            hook.remove()
        assert len(produced) == 4 and len(forwards) == 1
        engine.run_to_completion()
        assert all(s.cache is None and len(s.output_ids) == 4 for s in seqs)  # finished: caches freed


def test_prefill_chunks_beside_a_batched_decode_keep_exact_results(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, prefill_chunk=4, progress=False) as llm:
        engine = llm.engine
        greedy = SamplingParams(max_tokens=6, ignore_eos=True)
        decoding = [engine.add(p, greedy) for p in ([5, 6], [7, 8])]
        engine.step()
        late = engine.add(list(range(10, 22)), greedy)  # 12 tokens: three chunks beside the two decodes
        while late.prefilling:
            engine.step()
        engine.run_to_completion()
        for seq in [*decoding, late]:
            assert seq.output_ids == llm.generate(seq.prompt_ids, greedy)[0].token_ids


class RoutesByRow:
    """A recorder that files each routed row under (layer, request, position), as PassInfo attributes it."""

    enabled = True

    def __init__(self):
        self.routes: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self.info = None

    def begin_pass(self, info) -> None:
        self.info = info

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        requests, positions, _ = row_table(self.info)
        for request, position, ids in zip(requests.tolist(), positions.tolist(), ids_TK.tolist()):
            self.routes[(layer, request, position)] = tuple(sorted(ids))

    def end_pass(self) -> None:
        self.info = None


def test_recorded_rows_follow_the_order_the_moe_blocks_see(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, progress=False) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=4, ignore_eos=True)

        def copy_of(seq: Sequence) -> Sequence:
            return Sequence(seq.seq_id, seq.prompt_ids, params, new_generator(0), list(seq.output_ids), seq.num_fed,
                            copy.deepcopy(seq.cache))

        decoding = [Sequence(i, prompt, params, new_generator(0)) for i, prompt in ((1, [5, 6, 7]), (2, [8, 9]))]
        for seq in decoding:
            engine._forward(seq, seq.prompt_ids)
            seq.num_fed = len(seq.prompt_ids)
            seq.output_ids.append(50)
        fresh = Sequence(3, [10, 11, 12, 13], params, new_generator(0))
        # a prefilling sequence first: the batched decode of the other two runs first at the MoE blocks
        batch, inputs = [fresh, *decoding], [fresh.prompt_ids, [50], [50]]
        alone = RoutesByRow()
        engine.set_recorder(alone)
        for seq, tokens in zip(batch, inputs):
            engine._recorded_forward([copy_of(seq)], [tokens])
        together = RoutesByRow()
        engine.set_recorder(together)
        engine._recorded_forward(batch, inputs)
        assert len(together.routes) == len(alone.routes) == 2 * (4 + 1 + 1)  # 2 MoE layers x 6 rows
        assert together.routes == alone.routes


def test_decode_groups_bound_the_padding():
    assert decode_groups([5, 5, 5]) == [[0, 1, 2]]
    assert decode_groups([3, 900, 1, 40]) == [[1, 3, 0, 2]]  # short contexts: the allowance covers the padding
    # no allowance: pad positions at most half the real ones; the longest first; a lone row is left to run alone
    assert decode_groups([10, 100, 10, 10], pad_allowance=0) == [[0, 2, 3]]
    assert decode_groups([1000, 10, 10], pad_allowance=0) == [[1, 2]]
    assert decode_groups([40, 40, 1, 1, 1, 1], pad_allowance=0) == [[0, 1, 2], [3, 4, 5]]
    past = [7, 300, 12, 299, 64, 1, 150, 151, 3]
    groups = decode_groups(past, pad_allowance=16)
    rows = [i for g in groups for i in g]
    assert len(rows) == len(set(rows)) and all(len(g) >= 2 for g in groups)
    for g in groups:
        real = sum(past[i] + 1 for i in g)
        assert len(g) * (max(past[i] for i in g) + 1) - real <= max(real // 2, 16)


def test_rows_of_very_different_lengths_decode_in_separate_batches_exactly(tiny_dir, monkeypatch):
    monkeypatch.setattr(engine_module, "decode_groups", lambda past: decode_groups(past, pad_allowance=0))
    prompts = [[5] * 40, [6] * 40, [7], [8], [9], [10]]
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    with LLM(tiny_dir("deepseek_v3"), dtype=torch.float32, progress=False) as llm:
        engine = llm.engine
        batches = []
        original = engine._forward_decode
        engine._forward_decode = lambda seqs, tokens: (batches.append(len(seqs)), original(seqs, tokens))[1]
        together = llm.generate(prompts, greedy)
        assert batches[:2] == [3, 3]  # first decode step: the two long rows and a short one, then three short ones
        for prompt, result in zip(prompts, together):
            assert result.token_ids == llm.generate(prompt, greedy)[0].token_ids


def test_left_pad_stack_right_aligns_rows():
    a, b = torch.ones(1, 2, 3, 4), torch.full((1, 2, 1, 4), 2.0)
    out = left_pad_stack([a, b])
    assert out.shape == (2, 2, 3, 4)
    assert torch.equal(out[0], a[0])
    assert torch.equal(out[1, :, 2], b[0, :, 0]) and not out[1, :, :2].any()
