"""The placement benchmark's requests: a calibration split for statistics, a held-out split to measure.

Both come from one dataset through `tiermoe.data`'s seeded split by conversation, so no conversation feeds both
the statistics of `frequency` / `balanced` and the measurement. Each request is token ids plus its own output
length: ShareGPT-style serving benchmarks fix output lengths (ignore EOS) so every placement generates the same
tokens; here each request's length is drawn once, seeded, between half and all of `output_len`, so requests
finish at different times and continuous batching admits new ones as a server would.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from tiermoe.data import load_prompts, select
from tiermoe.data.prompts import Prompt
from tiermoe.errors import TiermoeError


@dataclass(frozen=True)
class Workload:
    """Requests to run: prompt token ids and each request's output length (tokens, EOS ignored)."""

    name: str  # "calibration" | "held-out"
    prompt_ids: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]
    prompt_names: tuple[str, ...] = ()
    trace_requests: tuple[int, ...] = ()  # with routing from a trace: the trace request each prompt replays

    def __post_init__(self):
        if len(self.prompt_ids) != len(self.output_lens) or not self.prompt_ids:
            raise TiermoeError(f"the {self.name} workload needs one output length per prompt and at least one prompt")

    @property
    def num_requests(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> str:
        return (f"{self.num_requests} requests, {self.prompt_tokens} prompt tokens "
                f"(mean {self.prompt_tokens / self.num_requests:.0f}), {self.output_tokens} output tokens")


@dataclass(frozen=True)
class WorkloadSpec:
    """Which prompts and how long their answers are."""

    dataset: str
    num_prompts: int = 32
    calibration_prompts: int = 64
    output_len: int = 64
    max_prompt_tokens: int = 512
    heldout_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self):
        if self.num_prompts < 1 or self.calibration_prompts < 1 or self.output_len < 1 or self.max_prompt_tokens < 1:
            raise TiermoeError("num_prompts, calibration_prompts, output_len and max_prompt_tokens must be >= 1")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise TiermoeError(f"heldout_fraction must be between 0 and 1 (exclusive), got {self.heldout_fraction}")


def build_workloads(spec: WorkloadSpec, encode: Callable[[Prompt], list[int]]) -> tuple[Workload, Workload]:
    """(calibration, held-out) workloads of `spec.dataset`; `encode` turns a Prompt into token ids
    (chat template applied when the tokenizer has one)."""
    prompts = load_prompts(spec.dataset)
    calibration = _encoded("calibration", select(prompts, None, spec.seed, part="train",
                                                 heldout_fraction=spec.heldout_fraction),
                           spec.calibration_prompts, spec, encode, seed=spec.seed + 1)
    heldout = _encoded("held-out", select(prompts, None, spec.seed, part="heldout",
                                          heldout_fraction=spec.heldout_fraction),
                       spec.num_prompts, spec, encode, seed=spec.seed)
    return calibration, heldout


def _encoded(name: str, candidates: list[Prompt], num: int, spec: WorkloadSpec, encode, seed: int) -> Workload:
    chosen, ids = [], []
    for prompt in candidates:
        if len(chosen) == num:
            break
        tokens = encode(prompt)
        if 0 < len(tokens) <= spec.max_prompt_tokens:
            chosen.append(prompt.id)
            ids.append(tuple(tokens))
    if len(ids) < num:
        raise TiermoeError(f"'{spec.dataset}' has only {len(ids)} {name} prompts of at most {spec.max_prompt_tokens} "
                           f"tokens (of {len(candidates)} in that split), {num} asked for; lower the number, raise "
                           "--max-prompt-tokens, or change --heldout-fraction")
    rng = random.Random(seed)
    lens = tuple(rng.randint(max(1, spec.output_len // 2), spec.output_len) for _ in ids)
    return Workload(name, tuple(ids), lens, tuple(chosen))


def prompt_encoder(llm) -> Callable[[Prompt], list[int]]:
    """Prompt -> token ids with `llm`'s tokenizer: its chat template for chat prompts when it has one."""
    if llm.tokenizer is None:
        raise TiermoeError(f"{llm.model_dir} has no tokenizer; the placement benchmark encodes dataset prompts")
    chat = bool(getattr(llm.tokenizer, "chat_template", None))

    def encode(prompt: Prompt) -> list[int]:
        if chat and prompt.is_chat:
            return llm.chat_prompt_ids(prompt.chat_messages())
        return llm.encode(prompt.plain_text())

    return encode
