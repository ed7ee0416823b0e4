"""Log-probabilities: the generated tokens' and the prompt's equal log_softmax of the unmodified transformers model's
logits (fp32), whatever the batch, the prefill chunking or the sampling settings."""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference

from tiermoe.engine.llm import LLM
from tiermoe.engine.logprobs import MAX_TOP_LOGPROBS, logprobs_at
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34]]


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the transformers model's logits at every position of `ids` [T, V]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def run(tiny_dir):
    path = tiny_dir("qwen3_moe")
    ref = load_reference(path)
    mask = torch.rand(3, 8, generator=torch.Generator().manual_seed(3)) < 0.5
    # chunks of 4 split the long prompt; two running at a time leave the third waiting
    with LLM(path, placement=mask, dtype=torch.float32, max_running=2, prefill_chunk=4, progress=False) as llm:
        yield llm, ref


def test_generated_and_prompt_logprobs_equal_transformers(run):
    llm, ref = run
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        expected = reference_logprobs(ref, prompt + out.token_ids)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        for t, lp in enumerate(out.logprobs):
            row = expected[len(prompt) - 1 + t]
            assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-5)
            assert [i for i, _ in lp.top] == row.topk(3).indices.tolist()
            assert lp.top[0][0] == lp.token_id  # greedy: the chosen token is the most likely
        assert [lp.token_id for lp in out.prompt_logprobs] == prompt[1:]
        for t, lp in enumerate(out.prompt_logprobs):
            assert lp.logprob == pytest.approx(float(expected[t, prompt[t + 1]]), abs=1e-5)
            assert len(lp.top) == 2


def test_logprobs_do_not_depend_on_sampling_settings(run):
    llm, _ = run
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0))[0]
    hot = llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, ignore_eos=True, logprobs=0, temperature=1.9,
                                                  top_k=2, top_p=0.5, seed=1))[0]
    forced = logprobs_at(reference_logprobs(run[1], PROMPTS[0])[-1:], hot.token_ids, 0)[0]
    assert hot.logprobs[0].logprob == pytest.approx(forced.logprob, abs=1e-5)  # the model's, not the filtered
    assert greedy.logprobs[0].top == ()  # logprobs 0: the chosen token only


def test_max_tokens_zero_scores_the_prompt_only(run):
    llm, ref = run
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    expected = reference_logprobs(ref, PROMPTS[2])
    assert [lp.logprob for lp in out.prompt_logprobs] == pytest.approx(
        [float(expected[t, PROMPTS[2][t + 1]]) for t in range(len(PROMPTS[2]) - 1)], abs=1e-5)


def test_requests_without_logprobs_get_none(run):
    out = run[0].generate(PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert out.logprobs is None and out.prompt_logprobs is None


@pytest.mark.parametrize("kwargs, message", [
    ({"logprobs": MAX_TOP_LOGPROBS + 1}, "logprobs must be an integer from 0 to 20"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be an integer from 0 to 20"),
    ({"max_tokens": 0}, "0 only to score the prompt"),
])
def test_bad_logprob_settings_are_refused(kwargs, message):
    with pytest.raises(TiermoeError, match=message):
        SamplingParams(**kwargs)


def test_ties_come_in_token_id_order():
    lp = logprobs_at(torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5]]), [2], top=3)[0]
    assert [i for i, _ in lp.top] == [1, 2, 3]


def test_alternatives_equal_a_stable_sort_of_the_vocabulary_and_the_transient_stays_bounded():
    """Scoring an `echo` prompt (issue: serving under hostile load, class 3): a top-k, not a sort of the vocabulary
    per row, with the same answer (ties in token-id order, many ties included), taking ROWS_AT_ONCE rows at a
    time so no tensor of [rows, vocab] larger than that is made."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tiermoe.engine.logprobs import ROWS_AT_ONCE

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and func.overloadpacket.__name__ != "slice":
                    Largest.numel = max(Largest.numel, t.numel() if not func.is_view else 0)
            return out

    g = torch.Generator().manual_seed(0)
    rows, vocab = 3 * ROWS_AT_ONCE + 5, 500
    logits = (torch.randn(rows, vocab, generator=g) * 2).round() / 2  # coarse values: ties everywhere
    logits[7] = 0.0  # a row of nothing but ties
    ids = torch.randint(0, vocab, (rows,), generator=g).tolist()
    with Largest():
        got = logprobs_at(logits, ids, top=5)
    assert Largest.numel <= ROWS_AT_ONCE * vocab
    logp = torch.log_softmax(logits, dim=-1)
    best = torch.sort(logp, dim=-1, descending=True, stable=True)
    for t, lp in enumerate(got):
        assert lp.top == tuple(zip(best.indices[t, :5].tolist(), best.values[t, :5].tolist())), t
        assert lp.logprob == logp[t, ids[t]].item()


def test_rows_whose_top_k_has_no_tie_at_its_cut_take_no_pass_over_the_vocabulary(monkeypatch):
    """One top-k of top + 1 decides a row whose (top + 1)-th value is below its top-th: only a row with a tie at
    the cut (or a NaN) takes the pass that finds every token at least its top-th value (0.5 ms a row of a 152k
    vocabulary); the answers stay those of a stable sort of the vocabulary."""
    from tiermoe.engine import logprobs

    passes = []
    slow = logprobs._top_with_ties
    monkeypatch.setattr(logprobs, "_top_with_ties", lambda row, top: passes.append(1) or slow(row, top))
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 3000, generator=g)  # distinct values
    logits[5, :8] = 9.0  # a tie across the cut of top 5
    logits[9, 100] = float("nan")
    got = logprobs_at(logits, list(range(40)), top=5)
    assert len(passes) == 2
    logp = torch.log_softmax(logits, dim=-1)
    best = torch.sort(logp, dim=-1, descending=True, stable=True)
    for t, lp in enumerate(got):
        if t != 9:
            assert lp.top == tuple(zip(best.indices[t, :5].tolist(), best.values[t, :5].tolist())), t
    assert [i for i, _ in got[5].top] == [0, 1, 2, 3, 4]
