"""One request's state inside the engine: token ids in, token ids out, its own KV cache and generator."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiermoe.engine.logprobs import TokenLogprob
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    num_fed: int = 0  # tokens of prompt + output already through the model (in the KV cache)
    cache: object | None = None  # the transformers cache object, created by the first forward
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_text_end: int | None = None  # where the returned text ends when a stop string matched
    error: str | None = None  # finish_reason "error": what failed, one line
    error_from_request: bool = False  # the error is the request's own fault (a TiermoeError): a 4xx, not a 5xx
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output id (params.logprobs set)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt ids 1.. (params.prompt_logprobs set)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.num_fed < len(self.prompt_ids)

    @property
    def scores_prompt(self) -> bool:
        """The next forward must keep every prompt position's logits (prompt logprobs asked, prefill not done)."""
        return self.params.prompt_logprobs is not None and self.prefilling

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def next_input(self, chunk: int) -> list[int]:
        """Tokens to feed in the next forward pass: a prompt chunk while prefilling, else the last output token."""
        if self.prefilling:
            return self.prompt_ids[self.num_fed:self.num_fed + chunk]
        return [self.output_ids[-1]]

    def fail(self, err: BaseException) -> None:
        """End with finish_reason "error" (the caller drops it from the running batch and releases it)."""
        self.finish_reason = "error"
        self.error_from_request = isinstance(err, TiermoeError)
        self.error = str(err) if self.error_from_request else f"{type(err).__name__}: {err}"

    def release(self) -> None:
        """Drop the KV cache (finished or aborted)."""
        self.cache = None
