"""Sampling parameters and the per-sequence sampler (pure: logits and a generator in, a token id out).

What changes the logits before the sampler sees them (penalties, logit_bias, min_tokens) is
tiermoe.engine.logits_processing; the sampler itself applies temperature, top_k, top_p and min_p.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from tiermoe.engine.logprobs import MAX_TOP_LOGPROBS
from tiermoe.errors import TiermoeError

# Below this temperature sampling is greedy (as in vLLM): logits / temperature would overflow fp32 for tiny
# temperatures (1e-40 turns every logit into inf and the probabilities into NaN), and the distribution is one-hot
# long before that anyway.
GREEDY_BELOW = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: +-100 bans or forces a token, whatever the logits
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's (and vLLM's, SGLang's) [-2, 2]
MAX_REPETITION_PENALTY = 100.0  # far beyond any useful value (1.1-1.5), and finite

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class Grammar:
    """What the reply must match: `kind` json_object (any JSON object; `source` empty), json_schema (`source` the
    schema as JSON text), regex or ebnf (`source` the expression or grammar)."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise TiermoeError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str) or (self.kind != "json_object" and not self.source):
            raise TiermoeError(f"a {self.kind} grammar needs its source text")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except ValueError:
                raise TiermoeError("a json_schema grammar's source must be JSON") from None
            if not isinstance(schema, (dict, bool)):
                raise TiermoeError("a json_schema grammar's schema must be a JSON object (or true/false)")


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

    As vLLM and SGLang apply them (tiermoe.engine.logits_processing): presence_penalty and frequency_penalty
    subtract `presence * (count > 0) + frequency * count` from the logit of each token by its count in the output
    so far; repetition_penalty (CTRL's, 1.0 off) divides the positive logits of tokens seen in the prompt or the
    output and multiplies the negative ones; logit_bias adds (token id, bias) pairs to the logits; min_tokens masks
    EOS and stop_token_ids (and skips the stop strings) until that many tokens are generated. min_p drops tokens
    whose probability is below min_p times the most likely one's. skip_special_tokens False keeps special tokens
    in the text (and in the text stop strings are searched in). grammar constrains the reply
    (tiermoe.engine.structured_output: the engine masks the logits each step to what the grammar allows).
    adapter runs the sequence with that LoRA adapter of the ones the engine serves per request
    (tiermoe.model.served_adapters); other sequences of the same steps keep theirs, or none.
    Log-probabilities stay the model's own, before any of these.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # a {id: bias} dict is taken too
    min_tokens: int = 0
    skip_special_tokens: bool = True
    grammar: Grammar | None = None
    adapter: str | None = None  # a LoRA adapter served per request, by name (Engine.adapters); None: the base model

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        self._check_limits()
        self._check_logits_processing()

    def _check_limits(self) -> None:
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
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise TiermoeError(f"stop_token_ids must be token ids (integers >= 0), got {list(self.stop_token_ids)}")

    def _check_logits_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise TiermoeError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise TiermoeError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 is off), got "
                               f"{self.repetition_penalty!r}")
        if not 0 <= self.min_p <= 1:
            raise TiermoeError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise TiermoeError(f"logit_bias: token {token}'s bias {bias!r} must be in [-{MAX_LOGIT_BIAS:g}, "
                                   f"{MAX_LOGIT_BIAS:g}] (and the id >= 0)")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise TiermoeError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise TiermoeError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise TiermoeError(f"grammar must be a Grammar, got {type(self.grammar).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the logits before sampling (the unconstrained path skips it all)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


def new_generator(seed: int | None) -> torch.Generator:
    """A host generator for one sequence: seeded when asked, else from fresh OS entropy."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(logits_V: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """Next token id from one position's logits [V]. A seeded request draws with torch.multinomial, so its tokens
    stay what they always were; an unseeded one by an inverse transform (`_inverse_transform`), the same
    distribution at a tenth of the cost."""
    if params.greedy:
        return int(torch.argmax(logits_V.float().cpu()))
    kept_V = _kept_mass(logits_V, params)
    if params.seed is None:
        return _inverse_transform(kept_V, gen)
    return int(torch.multinomial(kept_V, 1, generator=gen))


def _inverse_transform(kept_V: torch.Tensor, gen: torch.Generator) -> int:
    """One draw from the unnormalised masses kept_V [V] with ONE uniform number: the first token whose cumulative
    mass (in fp64) passes u x the total, so a token of mass 0 is never drawn. torch.multinomial draws V exponential
    numbers for one sample (its Gumbel-max form): 3-7 ms for a 152k vocabulary on a CPU, on the engine thread, for
    every sampled row of every step, which made each step of greedy streams beside a few sampled ones 1.5-2x as
    long; this costs about 0.3 ms. FlashInfer's samplers (SGLang's) are inverse transforms too."""
    cdf_V = torch.cumsum(kept_V, 0, dtype=torch.float64)
    total = cdf_V[-1]
    if not 0 < total < math.inf:  # what multinomial refuses: no mass, or NaN / inf in it
        raise TiermoeError(f"cannot sample: the kept probabilities sum to {float(total)}")
    u = torch.rand(1, generator=gen, dtype=torch.float64) * total
    return int(torch.searchsorted(cdf_V, u, right=True).clamp_(max=len(cdf_V) - 1))


def probabilities(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution [V] (fp32, host, summing to 1) that `sample` draws from when not greedy. Speculative
    verification accepts drafted tokens against it (tiermoe.engine.speculative_verify)."""
    kept_V = _kept_mass(logits_V, params)
    return kept_V / kept_V.sum()


def _kept_mass(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / temperature) with what top_k, top_p and min_p drop set to 0, not renormalised (multinomial
    needs no normalising: leaving it out keeps seeded draws what they always were)."""
    logits_V = logits_V.float().cpu() / max(params.temperature, GREEDY_BELOW)
    support_S = None  # the only tokens with mass, when top_k says (top_p then sorts those, not the vocabulary)
    if params.top_k:
        k = min(params.top_k, logits_V.numel())
        top = torch.topk(logits_V, k)
        dropped_V = logits_V < top.values[-1]
        logits_V = logits_V.masked_fill(dropped_V, float("-inf"))
        # the k tokens; when others tie with the k-th, every token left (a rare full pass)
        support_S = top.indices if int(dropped_V.sum()) == len(dropped_V) - k else torch.nonzero(~dropped_V)[:, 0]
    probs_V = torch.softmax(logits_V, dim=-1)
    if params.top_p < 1.0:
        # a Qwen3 checkpoint's default top_k 20 + top_p 0.95 sorted all 152k probabilities: 5-7 ms a sampled row on
        # one core of a 2-core EPYC, 0.7 ms with the sort of the top 20 alone
        probs_V = _top_p(probs_V, params.top_p, support_S)
    if params.min_p > 0:  # relative to the most likely token, which top-k and top-p always keep
        probs_V = probs_V.masked_fill(probs_V < params.min_p * probs_V.max(), 0)
    return probs_V


def _top_p(probs_V: torch.Tensor, top_p: float, support_S: torch.Tensor | None) -> torch.Tensor:
    """probs_V with all but the smallest most-likely prefix whose mass reaches top_p set to 0 (the first token
    always stays). `support_S`: the only indices with mass (None: any may have). The zeros a full sort would put
    after them change no prefix sum, so sorting the support alone keeps the same tokens."""
    if support_S is None:
        sorted_p, order = torch.sort(probs_V, descending=True)
    else:
        sorted_p, by_mass = torch.sort(probs_V[support_S], descending=True)
        order = support_S[by_mass]
    drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= top_p
    drop[0] = False  # a top_p below fp32's smallest value compares as 0 and would drop it too
    return probs_V.index_fill(0, order[drop], 0.0)
