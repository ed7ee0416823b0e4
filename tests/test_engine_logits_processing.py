"""Penalties, logit_bias, min_tokens and min_p (tiermoe.engine.logits_processing, tiermoe.engine.sampling): each
follows vLLM's formula, step after step as the output grows, and leaves the model's logits (the logprobs') alone;
a request that asks for none of them is not touched at all."""

from __future__ import annotations

import pytest
import torch

from tiermoe.engine.logits_processing import LogitsAdjuster
from tiermoe.engine.sampling import (
    Grammar,
    SamplingParams,
    new_generator,
    sample,
)
from tiermoe.errors import TiermoeError

VOCAB = 40


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
              eos: set[int]) -> torch.Tensor:
    """vLLM's order and formulas, written out densely."""
    out = logits.clone()
    if len(output) < params.min_tokens:
        for token in {*params.stop_token_ids, *(() if params.ignore_eos else eos)}:
            out[token] = float("-inf")
    for token, bias in params.logit_bias:
        out[token] += bias
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
    seen = (counts > 0) | (torch.bincount(torch.tensor(prompt), minlength=VOCAB) > 0)
    rp = params.repetition_penalty
    out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    return out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


@pytest.mark.parametrize("options", [
    {"presence_penalty": 1.5}, {"frequency_penalty": -0.7}, {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.6, "frequency_penalty": 0.3, "presence_penalty": -0.2, "logit_bias": {3: 5.0, 7: -100}},
    {"min_tokens": 4, "stop_token_ids": (9,)}, {"min_tokens": 4, "ignore_eos": True},
], ids=str)
def test_the_adjusted_logits_follow_the_formulas_step_after_step(options):
    params = SamplingParams(max_tokens=16, **options)
    prompt, eos = [1, 5, 5, 8], {2}
    adjuster = LogitsAdjuster(params, prompt, eos)
    gen = torch.Generator().manual_seed(0)
    output = []
    for step in range(8):
        logits = torch.randn(VOCAB, generator=gen)
        given = logits.clone()
        adjusted = adjuster.adjust(logits, output)
        torch.testing.assert_close(adjusted, reference(given, params, prompt, output, eos))
        assert torch.equal(logits, given)  # the model's logits stay as they were: logprobs come from them
        output.append([5, 8, 3, 8, 8, 11, 2, 9][step])  # repeats, a prompt token, EOS and a stop id


def test_min_p_keeps_only_the_tokens_near_the_most_likely():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    wide = SamplingParams(temperature=1.0, min_p=0.5)
    drawn = {sample(logits, wide, new_generator(seed)) for seed in range(200)}
    assert drawn == {0, 1}  # 0.15 < 0.5 x 0.4
    assert {sample(logits, SamplingParams(temperature=1.0), new_generator(seed)) for seed in range(200)} > drawn
    assert {sample(logits, SamplingParams(temperature=1.0, min_p=1.0), new_generator(s)) for s in range(50)} == {0}


def test_a_request_without_them_is_not_adjusted():
    assert not SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3).adjusts_logits
    assert SamplingParams(logit_bias={4: 1.0}).adjusts_logits and SamplingParams(min_tokens=1).adjusts_logits


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
    ({"min_p": 1.5}, "min_p must be in"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens (9) must not exceed max_tokens (8)"),
    ({"stop_token_ids": (-3,)}, "stop_token_ids"),
])
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(TiermoeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**kwargs)


def test_a_grammar_is_checked_for_shape():
    with pytest.raises(TiermoeError, match="source must be JSON"):
        Grammar("json_schema", "{nope")
    with pytest.raises(TiermoeError, match="kind must be one of"):
        Grammar("xml", "<a/>")
    grammar = Grammar("regex", "a+")
    assert SamplingParams(grammar=grammar).grammar == grammar
