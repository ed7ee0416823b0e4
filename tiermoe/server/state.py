"""What the HTTP handlers share: the loaded model, the engine service, counters, settings."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from starlette.concurrency import run_in_threadpool

from tiermoe.config import ServerConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.model.lora_merge import MergedLoRA
from tiermoe.server.admission import Admission
from tiermoe.server.engine_service import EngineService
from tiermoe.server.expert_metrics import ExpertLoadCounter
from tiermoe.server.logprob_format import TokenText, token_text_of
from tiermoe.server.metrics import ServerMetrics
from tiermoe.server.model_card import parameter_count
from tiermoe.server.output_parsers import OutputParser, keeping_markers
from tiermoe.server.request_options import RequestOptions
from tiermoe.stats.tier_hits import TierHitCounter


@dataclass
class ServerState:
    llm: LLM
    config: ServerConfig
    service: EngineService
    metrics: ServerMetrics
    hits: TierHitCounter
    model_name: str
    recorder_control: object | None = None  # start/stop/dump of the expert distribution recorder
    expert_load: ExpertLoadCounter | None = None  # --enable-expert-distribution-metrics
    # reads an adapter directory (POST /load_lora_adapter) into what the engine serves per request; None: loading
    # adapters while serving is off (no --enable-lora, no --lora NAME=DIR)
    adapter_reader: Callable[[str], MergedLoRA] | None = None
    started: float = field(default_factory=time.time)
    # one tokenisation at a time: a fast tokenizer's settings are not safe to touch from two threads at once
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    admission: Admission = field(init=False)  # generation requests in flight, bounded (--max-queued-requests)

    def __post_init__(self):
        config = self.config
        self.admission = Admission(config.in_flight_limit, config.max_running_requests, config.queue_limit)
        if self.output_parser is not None and self.llm.tokenizer is not None:
            # the replies' text (streamed, and searched for stop strings) keeps the markers the parsers read, which
            # tokenizers often mark special and the engine's own detokenizer would drop
            self.llm.engine.detokenize = keeping_markers(self.llm.tokenizer, self.output_parser.markers)

    @property
    def adapters(self) -> frozenset[str]:
        """The LoRA adapters a request may ask for by name (served per request: tiermoe.model.served_adapters)."""
        served = self.llm.engine.adapters
        return served.names if served is not None else frozenset()

    @cached_property
    def output_parser(self) -> OutputParser | None:
        """Splits chat replies into reasoning, content and tool calls (--reasoning-parser, --tool-call-parser)."""
        config = self.config
        if config.reasoning_parser is None and config.tool_call_parser is None:
            return None
        return OutputParser(config.reasoning_parser, config.tool_call_parser)

    @cached_property
    def parameter_count(self) -> int:
        """The checkpoint's parameters (Ollama's /api/tags and /api/show), read from its headers once."""
        return parameter_count(self.llm)

    @property
    def context_length(self) -> int | None:
        return self.llm.engine.max_context

    @cached_property
    def max_token_chars(self) -> int | None:
        """Characters one token of text covers at most: the longest vocabulary entry (a byte-level or
        sentencepiece entry has at least one character per character of text it stands for), times 4 since a
        normaliser (NFC, NFKC) can fold several characters into one."""
        vocab = self.llm.tokenizer.get_vocab() if self.llm.tokenizer is not None else None
        return 4 * max(map(len, vocab), default=1) if vocab else None

    @cached_property
    def token_text(self) -> TokenText:
        """One token id's text, as logprobs show it."""
        return token_text_of(self.llm.tokenizer)

    def check_prompt_chars(self, chars: int) -> None:
        """Refuse a prompt whose text cannot fit the context however it tokenises, before tokenising it (a 50 MB
        prompt would take a core for a minute and gigabytes of memory to find out)."""
        per_token = self.max_token_chars
        if self.context_length is None or per_token is None or chars <= self.context_length * per_token:
            return
        raise TiermoeError(f"the prompt has {chars} characters; this model's context of {self.context_length} tokens "
                           f"holds at most {self.context_length * per_token} (it was not tokenised)")

    async def tokenize(self, chars: int, encode: Callable[[], list[int]]) -> list[int]:
        """`encode()` (tokenising, a chat template) on a worker thread, so the event loop keeps serving /health
        and the other clients meanwhile; refused first if `chars` characters cannot fit the context."""
        def work() -> list[int]:
            self.check_prompt_chars(chars)
            with self._tokenizer_lock:
                return encode()

        return await run_in_threadpool(work)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise TiermoeError("the prompt is empty")
        if self.context_length is not None and len(prompt_ids) >= self.context_length:
            raise TiermoeError(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                               f"{self.context_length} tokens")
        self.llm.engine.check_token_ids(prompt_ids)

    def sampling(self, prompt_ids: list[int], options: RequestOptions, fallback: dict | None = None,
                 default_max_tokens: int | None = None, logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams for a request's `options` (tiermoe.server.request_options), with max_tokens checked
        against the context and the token budget, and the token ids it names against the vocabulary. A sampling
        value not given takes the checkpoint's generation_config.json default, else the API's own (`fallback`); an
        absent max_tokens is `default_max_tokens` (default --default-max-tokens), within the context's room."""
        self.check_prompt(prompt_ids)
        room = (self.context_length - len(prompt_ids)) if self.context_length else None
        max_tokens = options.max_tokens
        if max_tokens is None:
            default = default_max_tokens or self.config.default_max_tokens
            max_tokens = default if room is None else min(default, room)
        elif room is not None and max_tokens > room:
            raise TiermoeError(f"max_tokens={max_tokens} is too large: the prompt has {len(prompt_ids)} tokens and "
                               f"the context is {self.context_length}, so at most {room} can be generated")
        budget = self.config.max_total_tokens
        if budget is not None and len(prompt_ids) + max_tokens > budget:
            raise TiermoeError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                               f"server's --max-total-tokens ({budget})")
        if options.min_tokens is not None and options.min_tokens > max_tokens:
            raise TiermoeError(f"{options.field('min_tokens')}: {options.min_tokens} is more than the "
                               f"{max_tokens} tokens this request may generate (max_tokens)")
        self.llm.engine.check_token_ids(list(options.stop_token_ids), options.field("stop_token_ids"))
        self.llm.engine.check_token_ids(list(options.logit_bias or ()), options.field("logit_bias"))
        return self.llm.generation_defaults.params(fallback, max_tokens=max_tokens, logprobs=logprobs,
                                                   prompt_logprobs=prompt_logprobs, **options.sampling_values())
