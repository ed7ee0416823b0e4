"""The adaptive policy's carry-over check at two lags: a request's own popularity carries over the next 4 passes but
much less over the next 16, so once the longer check has settled it caps the share followed; a workload that has
left its calibration for good (another task) carries over both, is followed as before, and is then valued with the
lighter caution."""

from __future__ import annotations

import torch

from tiermoe.placement.adaptive_policy import LONG_CHECK_PASSES, LONG_CHECK_SCORED, AdaptivePolicy, AdaptiveSettings
from tiermoe.placement.pass_cost import expert_cost_model

LAYERS, EXPERTS, REQUEST_PASSES = 4, 16, 8


def _serve(policy: AdaptivePolicy, passes: int, task_experts: bool) -> list[tuple[bool, float, float]]:
    """One token a pass, top-2. Each request (8 passes) has its own two hot experts per layer, which take 85% of
    its pairs (the rest are random); with `task_experts`, half of all pairs go to experts 0 and 1 of every layer
    first (the served task's). The calibration is uniform, which is what the request popularity averages to over
    many requests. Returns, per pass, (settled, the short check's share, the share the policy follows)."""
    gen = torch.Generator().manual_seed(0)
    seen = []
    for p in range(passes):
        if p % REQUEST_PASSES == 0:
            hot = torch.stack([torch.randperm(EXPERTS, generator=gen)[:2] for _ in range(LAYERS)])
        counts = torch.zeros(LAYERS, EXPERTS, dtype=torch.int64)
        for layer in range(LAYERS):
            for k in range(2):
                r = float(torch.rand((), generator=gen))
                if task_experts and r < 0.5:
                    counts[layer, k] += 1
                elif r < 0.85:
                    counts[layer, hot[layer, k]] += 1
                else:
                    counts[layer, torch.randint(EXPERTS, (), generator=gen)] += 1
        policy.observe(counts, 1, False)
        check = policy._lasting_check
        seen.append((check.settled, check.short.weight(policy.settings.z_score), policy.lasting_weight))
    return seen


def _policy() -> AdaptivePolicy:
    return AdaptivePolicy(LAYERS, EXPERTS, expert_cost_model(2**20, 2e6), AdaptiveSettings(),
                          torch.ones(LAYERS, EXPERTS))


def test_a_requests_own_popularity_is_followed_less_once_the_long_check_settles():
    policy = _policy()
    seen = _serve(policy, 400, task_experts=False)
    settles = next(p for p, (settled, _, _) in enumerate(seen) if settled)
    assert LONG_CHECK_PASSES * LONG_CHECK_SCORED <= settles < 2 * LONG_CHECK_PASSES * LONG_CHECK_SCORED
    settled, short, followed = seen[settles - 1]
    assert not settled and short > 0.2 and followed == short  # it carries over 4 passes...
    settled, short, followed = seen[-1]
    assert settled and short > 0.2 and followed < min(0.15, 0.6 * short)  # ...much less over 16
    assert policy._lasting_check.long.weight(policy.settings.z_score) == 0.0  # nothing shown to last that far
    assert policy.swap_z_score == policy.settings.settled_swap_z_score


def test_a_lasting_departure_from_the_calibration_is_followed_before_and_after_settling():
    policy = _policy()
    assert policy.swap_z_score == policy.settings.swap_z_score  # the caution while nothing has settled
    seen = _serve(policy, 400, task_experts=True)
    assert all(followed > 0.6 for _, _, followed in seen[40:])
    assert seen[-1][0] and seen[-1][2] > 0.9
    rates = policy.lasting_rates()
    assert bool((rates[:, :2].min(dim=1).values > 2 * rates[:, 2:].max(dim=1).values).all())  # the task's experts


def test_without_a_calibration_there_is_no_check_and_the_caution_stays():
    policy = AdaptivePolicy(LAYERS, EXPERTS, expert_cost_model(2**20, 2e6), AdaptiveSettings())
    policy.observe(torch.ones(LAYERS, EXPERTS, dtype=torch.int64), 8, False)
    assert policy.lasting_weight == 1.0 and policy.swap_z_score == policy.settings.swap_z_score


def test_a_lasting_swap_must_pay_over_the_range_of_the_share_the_long_check_allows():
    """lasting_range: the forecasts at u and at the long check's point estimate. Before settling they are one; on a
    request's own popularity the range reaches back toward the calibration (a swap that pays only at u, the upper
    end, is not made); on a lasting departure the long check confirms u and the range stays narrow."""
    for task_experts in (False, True):
        early = _policy()
        _serve(early, 100, task_experts)
        low, high = early.lasting_range()
        assert not early._lasting_check.settled and torch.equal(low, high) and torch.equal(low, early.lasting_rates())
        policy = _policy()
        _serve(policy, 400, task_experts)
        check, lasting, u = policy._lasting_check, policy.lasting_rates(), policy.lasting_weight
        followed, prior = policy._followed_and_prior()
        low, high = policy.lasting_range()
        assert check.settled and bool((low <= lasting).all()) and bool((lasting <= high).all())
        point = min(u, check.long.weight(0.0))
        # the range is the share between the point estimate and u, of each expert's deviation from the calibration
        assert torch.allclose(high - low, (u - point) * (followed - prior).abs())
        if task_experts:
            assert point == u  # confirmed: valued as followed
        else:
            assert point < 0.6 * u  # doubted: a swap must pay even at the lower share
