"""One request's state inside the engine: token ids in, token ids out, its pages of the KV pool and its generator.

`num_fed` counts the tokens whose K/V are in the pool. A sequence feeds chunks of its known tokens (the prompt;
after a preemption, the prompt and its output so far) until all are through, then one token per step; it samples
whenever a step brings `num_fed` to `num_tokens`. With speculative decoding a decoding sequence may feed its last
token and a `draft` (tiermoe.engine.speculative_drafting) in one step: the positions past the accepted ones are
then given back by setting `num_fed` to `num_tokens - 1` again, so they are never read and the next step
overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiermoe.engine.incremental_text import IncrementalText
from tiermoe.engine.kv_pool import SeqPages
from tiermoe.engine.logits_processing import LogitsAdjuster
from tiermoe.engine.logprobs import TokenLogprob
from tiermoe.engine.sampling import SamplingParams
from tiermoe.engine.speculative_length import AcceptanceEstimate
from tiermoe.engine.structured_output import GrammarState
from tiermoe.errors import TiermoeError
from tiermoe.model.served_adapters import LoadedAdapter


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    num_fed: int = 0  # tokens of prompt + output already through the model (K/V in the pool)
    pages: SeqPages | None = None  # its share of the engine's KV pool (tiermoe.engine.kv_pool)
    preemptions: int = 0  # times the pool took its pages back (it then recomputed them)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_text_end: int | None = None  # where the returned text ends when a stop string matched
    stop_string: str | None = None  # the stop string that matched first
    error: str | None = None  # finish_reason "error": what failed, one line
    error_from_request: bool = False  # the error is the request's own fault (a TiermoeError): a 4xx, not a 5xx
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output id (params.logprobs set)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt ids 1.. (params.prompt_logprobs set)
    decoded: IncrementalText | None = None  # its output's text, decoded as it grows (Engine.decoded_text)
    group: int | None = None  # the request it belongs to (a batch's prompts share one; None: its own)
    logits_adjuster: LogitsAdjuster | None = None  # its penalties' counts and bias (params.adjusts_logits only)
    grammar: GrammarState | None = None  # where its reply is in params.grammar (Engine.add compiles it)
    draft: list[int] = field(default_factory=list)  # drafted tokens it verifies in the step being run
    acceptance: AcceptanceEstimate | None = None  # its drafts' running acceptance (speculative decoding)
    adapter: LoadedAdapter | None = None  # the adapter it runs with (params.adapter, served per request)

    @property
    def adapter_slot(self) -> int:
        """Its rows' slot in the step (tiermoe.layers.adapter_rows): its adapter's, 0 without one."""
        return 0 if self.adapter is None else self.adapter.slot

    @property
    def prefix_salt(self) -> bytes:
        """What its pages' prefix-cache keys start with: KV computed with an adapter is found again only by it."""
        return b"" if self.adapter is None else self.adapter.salt

    @property
    def request(self) -> int:
        """What admission takes turns over: its request's group, or itself alone."""
        return self.group if self.group is not None else -1 - self.seq_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        """Feeding known tokens in chunks: the prompt, or a preempted sequence's prompt and output."""
        return self.num_fed < len(self.prompt_ids) or self.num_fed < self.num_tokens - 1

    @property
    def scores_prompt(self) -> bool:
        """The next forward must keep every fed position's logits (prompt logprobs asked, some not scored yet)."""
        return (self.params.prompt_logprobs is not None and self.num_fed < len(self.prompt_ids)
                and len(self.prompt_logprobs) < len(self.prompt_ids) - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def known_ids(self) -> list[int]:
        """The prompt and the output so far."""
        return self.prompt_ids + self.output_ids

    def next_input(self, chunk: int) -> list[int]:
        """Tokens to feed in the next forward pass: a chunk of the known ones while prefilling, else the last
        output token."""
        if self.prefilling:
            return self.known_ids[self.num_fed:self.num_fed + chunk]
        return [self.output_ids[-1]]

    def fail(self, err: BaseException) -> None:
        """End with finish_reason "error" (the caller drops it from the running batch and frees its pages)."""
        self.finish_reason = "error"
        self.error_from_request = isinstance(err, TiermoeError)
        self.error = str(err) if self.error_from_request else f"{type(err).__name__}: {err}"

