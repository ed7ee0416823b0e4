"""Verifying one drafted token against the target model's distribution at its position (pure: logits in, token out).

Greedy sequences take the argmax: the draft is accepted when it is the argmax, so the tokens are those of plain
decoding. Sampled sequences use rejection sampling for a deterministic drafter (n-gram lookup proposes one token
with probability 1): accept the draft d with probability p(d), else draw from p with d removed and renormalised.
The result is distributed as p exactly: P(d) = p(d), and for x != d, P(x) = (1 - p(d)) p(x) / (1 - p(d)) = p(x)
(Leviathan et al. 2023 with a one-hot draft distribution). p is what the sampler draws from (temperature, top-k,
top-p, min-p applied: tiermoe.engine.sampling.probabilities).
"""

from __future__ import annotations

import torch

from tiermoe.engine.sampling import SamplingParams, probabilities, sample


def verify_token(logits_V: torch.Tensor, params: SamplingParams, gen: torch.Generator, draft: int) -> int:
    """The token at this position: `draft` when accepted, else one drawn from the rest of the distribution."""
    if params.greedy:
        return sample(logits_V, params, gen)
    probs_V = probabilities(logits_V, params)
    if draft >= probs_V.numel():  # an embedding row the LM head lacks: never sampled, so never accepted
        return int(torch.multinomial(probs_V, 1, generator=gen))
    if float(torch.rand((), generator=gen)) < float(probs_V[draft]):
        return draft
    probs_V[draft] = 0  # p(draft) < 1 here (u < 1 always), so some mass is left
    return int(torch.multinomial(probs_V, 1, generator=gen))
