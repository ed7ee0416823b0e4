"""Speculative decoding's draft length and its verification of one token: pure functions, no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tiermoe.engine.sampling import SamplingParams, probabilities
from tiermoe.engine.speculative_config import SpeculativeConfig
from tiermoe.engine.speculative_drafting import Drafter
from tiermoe.engine.speculative_length import (
    PRIOR_ACCEPTANCE,
    AcceptanceEstimate,
    StepCost,
    StepShape,
    choose_draft_lengths,
    expected_tokens,
)
from tiermoe.engine.speculative_timing import MeasuredStepCost
from tiermoe.engine.speculative_verify import verify_token

QWEN3 = StepCost(num_experts=128, top_k=8, expert_share=0.6)


def test_the_cost_model_reads_the_issue_figures():
    # 4 consecutive tokens of one sequence read 2.64x one token's experts (Qwen3 decode trace): n ** 0.7
    assert QWEN3.union(4 ** QWEN3.reuse) / QWEN3.union(1) == pytest.approx(2.5, abs=0.15)
    assert QWEN3.relative(1, 1) == pytest.approx(1.0)
    assert expected_tokens(0.7, 3) == pytest.approx(1 + 0.7 + 0.49 + 0.343)


def test_no_draft_where_acceptance_is_too_low_to_pay_and_longer_ones_as_it_rises():
    lengths = [choose_draft_lengths(QWEN3, [rate], [8])[0] for rate in (0.0, 0.2, 0.5, 0.7, 0.9, 0.99)]
    assert lengths[0] == 0 and lengths[1] == 0
    assert lengths == sorted(lengths) and lengths[-1] >= 6 and lengths[3] >= 2
    assert choose_draft_lengths(QWEN3, [0.9], [2]) == [2]  # never more than the drafter found


def test_experts_that_cost_nothing_make_any_acceptance_pay_and_costly_ones_none():
    free = StepCost(num_experts=128, top_k=8, expert_share=0.0, row_share=0.0)
    assert choose_draft_lengths(free, [0.3], [4]) == [4]
    dear = StepCost(num_experts=128, top_k=8, expert_share=1.0, row_share=0.5)
    assert choose_draft_lengths(dear, [0.6], [4]) == [0]


def test_drafts_in_a_crowded_step_read_experts_its_other_rows_read_anyway():
    # 8 sequences already read about 50 of 128 experts a layer: a draft adds fewer new ones than alone
    alone = QWEN3.relative(2, 2 ** QWEN3.reuse) - QWEN3.relative(1, 1)
    crowded = QWEN3.relative(9, 7 + 2 ** QWEN3.reuse) - QWEN3.relative(8, 8)
    assert crowded < alone
    assert min(choose_draft_lengths(QWEN3, [0.6] * 8, [8] * 8)) >= choose_draft_lengths(QWEN3, [0.6], [8])[0]
    # a prefill chunk in the step (512 rows) reads nearly every expert: drafts are close to free there
    assert choose_draft_lengths(QWEN3, [0.3], [4], other_tokens=512) == [4]


def test_the_acceptance_estimate_follows_outcomes_and_drifts_back_when_idle():
    est = AcceptanceEstimate()
    start = est.rates
    for _ in range(10):
        est.update(4, 4)
    assert min(est.rates) > 0.8
    for _ in range(10):
        est.update(4, 0)
    assert est.first < 0.4
    low = est.first
    for _ in range(60):
        est.idle()
    assert low < est.first == pytest.approx(start[0], abs=0.02)


def test_a_new_sequence_starts_from_what_the_drafter_has_achieved():
    """A drafter that is never right: once a few of its drafts failed, a new sequence does not draft at all (with a
    fixed prior of 0.5 each new reply drafted some ten tokens in vain); one that is always right drafts at once; a
    drafter judged useless is tried again once its record has aged."""
    never, always = Drafter(SpeculativeConfig(), QWEN3, None), Drafter(SpeculativeConfig(), QWEN3, None)
    for _ in range(8):
        never.record(SimpleNamespace(acceptance=None), 4, 0)
        always.record(SimpleNamespace(acceptance=None), 4, 4)
    fresh = never.acceptance(SimpleNamespace(acceptance=None))
    assert fresh.first < 0.15 and choose_draft_lengths(QWEN3, [fresh.rates], [4]) == [0]
    assert choose_draft_lengths(QWEN3, [always.acceptance(SimpleNamespace(acceptance=None)).rates], [4]) == [4]
    for _ in range(600):  # steps without a draft: the record returns to the prior
        never.overall.idle()
    assert never.acceptance(SimpleNamespace(acceptance=None)).first == pytest.approx(PRIOR_ACCEPTANCE, abs=0.02)


def test_bursty_acceptance_keeps_long_drafts_worth_their_rows():
    """Half the drafts taken whole, half rejected at once: the first token is a coin flip, the rest near certain."""
    est = AcceptanceEstimate()
    for i in range(20):
        est.update(4, 4 if i % 2 else 0)
    assert est.first == pytest.approx(0.5, abs=0.1) and est.next > 0.9
    assert expected_tokens(est.rates, 4) > 2.6 > expected_tokens(0.5, 4)
    assert choose_draft_lengths(QWEN3, [est.rates], [8]) > choose_draft_lengths(QWEN3, [0.5], [8])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the distribution's support was drawn"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
@pytest.mark.parametrize("draft", [0, 5])
def test_verified_tokens_follow_the_target_distribution(params, draft):
    """Rejection sampling of a drafted token keeps the sampler's distribution (chi-square on a 6-token vocabulary,
    8000 draws: the 0.1% critical value for 5 degrees of freedom is 20.5)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    probs = probabilities(logits, params)
    gen = torch.Generator().manual_seed(7)
    draws = torch.tensor([verify_token(logits, params, gen, draft) for _ in range(8000)])
    counts = torch.bincount(draws, minlength=6).double()
    support = int((probs > 0).sum())
    assert chi_square(counts, probs.double()) < {6: 20.5, 5: 18.5, 4: 16.3, 3: 13.8, 2: 10.8}[support]


def test_a_biased_verifier_fails_the_chi_square_test():
    """The test above can fail: always accepting the draft half the time shifts the distribution."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    params = SamplingParams(temperature=1.0)
    probs = probabilities(logits, params)
    gen = torch.Generator().manual_seed(7)
    draws = [3 if i % 2 else verify_token(logits, params, gen, 3) for i in range(8000)]
    counts = torch.bincount(torch.tensor(draws), minlength=6).double()
    assert chi_square(counts, probs.double()) > 100


def test_greedy_verification_takes_the_argmax_whatever_the_draft():
    logits = torch.tensor([0.1, 3.0, 0.2])
    gen = torch.Generator().manual_seed(0)
    assert [verify_token(logits, SamplingParams(), gen, d) for d in (0, 1, 2)] == [1, 1, 1]


def test_the_measured_cost_learns_a_step_time_and_decides_with_it():
    measured = MeasuredStepCost(QWEN3)
    bytes_choice = choose_draft_lengths(measured, [0.7], [4])
    assert bytes_choice == choose_draft_lengths(QWEN3, [0.7], [4])  # the bytes model until steps are timed
    # this host: 10 ms a step, 2 ms per verifying sequence, 4 ms per drafted row: a draft of k costs 2 + 4k ms for
    # 0.7 + 0.49 + ... tokens more: never worth it
    for i in range(40):
        lengths = [i % 3, 0] if i % 2 else [0, 0]
        shape = StepShape.of(lengths)
        measured.observe(shape, 0.010 + 0.001 * shape.sequences + 0.002 * shape.verifying + 0.004 * shape.drafted)
    c0, c1, c2, c3 = measured.coefficients()
    assert c2 + c3 == pytest.approx(0.006, rel=0.05) and c0 + 2 * c1 == pytest.approx(0.012, rel=0.05)
    assert choose_draft_lengths(measured, [0.7], [4]) == [0]
    # where a drafted row is nearly free the same acceptance drafts
    cheap = MeasuredStepCost(QWEN3)
    for i in range(40):
        shape = StepShape.of([i % 5] if i % 2 else [0])
        cheap.observe(shape, 0.010 + 0.0002 * shape.drafted)
    assert choose_draft_lengths(cheap, [0.7], [4]) == [4]
    # steps with a prompt chunk are not fitted, and use the bytes model
    assert cheap.seconds(StepShape.of([1], other=64)) == QWEN3.seconds(StepShape.of([1], other=64))
