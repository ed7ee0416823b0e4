"""Sampling parameters and the per-sequence sampler (pure: logits and a generator in, a token id out)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tiermoe.engine.logprobs import MAX_TOP_LOGPROBS
from tiermoe.errors import TiermoeError

# Below this temperature sampling is greedy (as in vLLM): logits / temperature would overflow fp32 for tiny
# temperatures (1e-40 turns every logit into inf and the probabilities into NaN), and the distribution is one-hot
# long before that anyway.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature 0 is greedy, and so is any temperature below GREEDY_BELOW (1e-5). top_k 0 and top_p 1.0 disable
    those filters; top_p always keeps the most likely token, however small it is. With a seed the sampled tokens are
    reproducible. Generation stops at an EOS token (unless ignore_eos), a token of stop_token_ids, a stop string
    (the returned text ends before it), or after exactly max_tokens tokens.

    logprobs N returns each generated token's log-probability with the N most likely alternatives (0: none);
    prompt_logprobs N the same for every prompt token but the first. max_tokens 0 only scores the prompt (it needs
    prompt_logprobs): what an evaluation harness asks with echo and max_tokens 0.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise TiermoeError(f"max_tokens must be an integer >= 1 (0 only to score the prompt, with prompt "
                               f"logprobs), got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_TOP_LOGPROBS):
                raise TiermoeError(f"{name} must be an integer from 0 to {MAX_TOP_LOGPROBS} (alternatives per "
                                   f"token), got {value!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise TiermoeError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise TiermoeError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise TiermoeError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise TiermoeError("stop must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def new_generator(seed: int | None) -> torch.Generator:
    """A host generator for one sequence: seeded when asked, else from fresh OS entropy."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(logits_V: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """Next token id from one position's logits [V]."""
    logits_V = logits_V.float().cpu()
    if params.greedy:
        return int(torch.argmax(logits_V))
    logits_V = logits_V / params.temperature
    if params.top_k:
        kth = torch.topk(logits_V, min(params.top_k, logits_V.numel())).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    probs_V = torch.softmax(logits_V, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs_V, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= params.top_p
        drop[0] = False  # a top_p below fp32's smallest value compares as 0 and would drop it too
        sorted_p[drop] = 0
        probs_V = torch.zeros_like(probs_V).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs_V, 1, generator=gen))
