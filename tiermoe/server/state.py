"""What the HTTP handlers share: the loaded model, the engine service, counters, settings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tiermoe.config import ServerConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.server.engine_service import EngineService
from tiermoe.server.metrics import ServerMetrics
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
    started: float = field(default_factory=time.time)

    @property
    def context_length(self) -> int | None:
        return self.llm.engine.max_context

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise TiermoeError("the prompt is empty")
        if self.context_length is not None and len(prompt_ids) >= self.context_length:
            raise TiermoeError(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                               f"{self.context_length} tokens")
        self.llm.engine.check_token_ids(prompt_ids)

    def sampling(self, prompt_ids: list[int], max_tokens: int | None, **kwargs) -> SamplingParams:
        """SamplingParams for a request, with max_tokens checked against the context and the token budget."""
        self.check_prompt(prompt_ids)
        room = (self.context_length - len(prompt_ids)) if self.context_length else None
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens if room is None else min(self.config.default_max_tokens, room)
        elif room is not None and max_tokens > room:
            raise TiermoeError(f"max_tokens={max_tokens} is too large: the prompt has {len(prompt_ids)} tokens and "
                               f"the context is {self.context_length}, so at most {room} can be generated")
        budget = self.config.max_total_tokens
        if budget is not None and len(prompt_ids) + max_tokens > budget:
            raise TiermoeError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                               f"server's --max-total-tokens ({budget})")
        return SamplingParams(max_tokens=max_tokens, **kwargs)
