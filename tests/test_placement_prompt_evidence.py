"""Prefill-time placement: a request's prompt routing as evidence for its decode, with a learned, bounded weight."""

from __future__ import annotations

import pytest
import torch

from tiermoe.errors import TiermoeError
from tiermoe.placement.adaptive_policy import AdaptivePolicy, AdaptiveSettings
from tiermoe.placement.pass_cost import expert_cost_model

E = 8
COST = expert_cost_model(1 << 20, 0.0)


def _tokens(hot: int, share: float, n: int, gen: torch.Generator) -> torch.Tensor:
    """n top-1 ids: `hot` with probability `share`, else uniform."""
    uniform = torch.randint(0, E, (n,), generator=gen)
    return torch.where(torch.rand(n, generator=gen) < share, torch.full((n,), hot), uniform)


def _request(policy, prompt_hot: int, decode_hot: int, gen, prompt_share=0.6, decode_share=0.6, n=32) -> None:
    """One request at a time: a prompt of n tokens in one prefill pass, then n decode tokens one a pass."""
    ids = _tokens(prompt_hot, prompt_share, n, gen)
    policy.observe(torch.bincount(ids, minlength=E)[None], n, True)
    for i in _tokens(decode_hot, decode_share, n, gen).tolist():
        policy.observe(torch.nn.functional.one_hot(torch.tensor([i]), E), 1, False)


def _policy(**fields) -> AdaptivePolicy:
    return AdaptivePolicy(1, E, COST, AdaptiveSettings(prompt_evidence=True, **fields), torch.ones(1, E))


def test_a_prompt_that_predicts_its_answer_moves_the_forecast_by_the_learned_weight():
    policy, gen = _policy(), torch.Generator().manual_seed(0)
    assert policy.prompt_weight == 0.0  # nothing learned yet: the prompt is no evidence
    for r in range(12):
        _request(policy, r % E, r % E, gen)  # each request has its own hot expert, in prompt and answer alike
    ids = _tokens(5, 0.6, 32, gen)
    policy.observe(torch.bincount(ids, minlength=E)[None], 32, True)  # a new request's prompt
    w = policy.prompt_weight
    assert 0.3 < w <= 1.0
    lasting, forecast = policy.lasting_rates(), policy.request_rates()
    # the documented forecast: lasting + w x (this prompt - the typical prompt), never below 0
    assert torch.allclose(forecast, (lasting + w * policy.prompts.deviation()).clamp(min=0.0))
    assert int(forecast[0].argmax()) == 5 and forecast[0, 5] > lasting[0, 5] + 0.1
    # before its first decode token the policy moves the prompt's hot expert in, within the copy budget
    mask = torch.zeros(1, E, dtype=torch.bool)
    mask[0, [0, 1]] = True
    swaps = policy.propose(mask, torch.zeros(1, E, dtype=torch.bool))
    assert 0 < len(swaps) <= policy.settings.max_swaps_in_flight and swaps[0].expert_in == 5


def test_a_prompt_that_does_not_predict_its_answer_is_ignored():
    policy, gen = _policy(), torch.Generator().manual_seed(1)
    for r in range(12):
        _request(policy, r % E, (3 * r + 5) % E, gen)  # the answer's hot expert is another one
    assert policy.prompt_weight == 0.0
    _request(policy, 2, 6, gen, n=4)
    assert torch.equal(policy.request_rates(), policy.lasting_rates())


def test_the_prompt_weight_is_bounded():
    policy, gen = _policy(), torch.Generator().manual_seed(2)
    for r in range(12):  # answers far more concentrated than their prompts: the raw slope is above 1
        _request(policy, r % E, r % E, gen, prompt_share=0.3, decode_share=1.0)
    assert policy.prompts.fit.cov / policy.prompts.fit.var > 1.0
    assert policy.prompt_weight == 1.0
    fixed = _policy(prompt_weight=0.4)  # a fixed weight skips the learning; one outside [0, 1] is refused
    _request(fixed, 3, 3, gen, n=4)
    assert fixed.prompt_weight == 0.4
    with pytest.raises(TiermoeError, match="prompt_weight"):
        _policy(prompt_weight=2.0)
    off = AdaptivePolicy(1, E, COST, AdaptiveSettings(prompt_evidence=False), torch.ones(1, E))
    for r in range(12):
        _request(off, r % E, r % E, gen)
    assert off.prompt_weight == 0.0 and torch.equal(off.request_rates(), off.lasting_rates())
