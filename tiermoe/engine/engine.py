"""The engine: a step function that advances a batch of sequences by one forward pass each.

Sequences wait in a queue until admitted (at most `max_running` at once). In a step every running sequence feeds
its next input (a prompt chunk of at most `prefill_chunk` tokens while prefilling, else its last token), with its
own KV cache and positions; the MoE blocks of all of them run once per layer for the whole batch (MoEBatcher).
A sequence whose prompt is complete samples one token. The engine sees token ids only; text (stop strings) is
reached through the `detokenize` function it is given.
"""

from __future__ import annotations

import inspect
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tiermoe.engine.moe_batcher import MoEBatcher
from tiermoe.engine.sampling import SamplingParams, new_generator, sample
from tiermoe.engine.sequence import Sequence
from tiermoe.errors import TiermoeError
from tiermoe.stats.recording import NO_RECORDER, ExpertRecorder, PassInfo


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 16  # sequences advanced together in one step
    prefill_chunk: int = 512  # prompt tokens one sequence feeds per step

    def __post_init__(self):
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


class Engine:
    def __init__(self, hybrid, eos_token_ids: Iterable[int] = (), detokenize: Callable[[list[int]], str] | None = None,
                 config: EngineConfig = EngineConfig(), recorder: ExpertRecorder = NO_RECORDER):
        self.hybrid = hybrid
        self.model = hybrid.model
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.max_context = getattr(hybrid.config, "max_position_embeddings", None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self._batcher = MoEBatcher(config.max_running)
        self.recorder = recorder
        for block in hybrid.blocks.values():
            block.batcher = self._batcher
            block.recorder = recorder
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def close(self) -> None:
        for block in self.hybrid.blocks.values():
            block.batcher = None
            block.recorder = NO_RECORDER
        self._batcher.close()

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; returns its Sequence (filled in as steps run)."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise TiermoeError("a prompt needs at least one token")
        if self.max_context is not None and len(prompt_ids) >= self.max_context:
            raise TiermoeError(f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_context}")
        if params.stop and self.detokenize is None:
            raise TiermoeError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        seq = Sequence(next(self._ids), prompt_ids, params, new_generator(params.seed))
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence now and free its cache (a client went away)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.finish_reason = seq.finish_reason or "abort"
        seq.release()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Sequence]:
        """One forward pass for every running sequence; returns those that produced a token this step."""
        while self.waiting and len(self.running) < self.config.max_running:
            self.running.append(self.waiting.popleft())
        if not self.running:
            return []
        batch = list(self.running)
        inputs = [seq.next_input(self.config.prefill_chunk) for seq in batch]
        if self.recorder.enabled:
            self.recorder.begin_pass(PassInfo(
                request_ids=tuple(s.seq_id for s in batch), num_tokens=tuple(len(x) for x in inputs),
                start_positions=tuple(s.num_fed for s in batch), is_prefill=tuple(s.prefilling for s in batch)))
        logits = self._batcher.run([lambda s=s, x=x: self._forward(s, x) for s, x in zip(batch, inputs)])
        if self.recorder.enabled:
            self.recorder.end_pass()
        produced = []
        for seq, fed, logits_V in zip(batch, inputs, logits):
            seq.num_fed += len(fed)
            if seq.prefilling:
                continue
            seq.output_ids.append(sample(logits_V, seq.params, seq.generator))
            self._check_stop(seq)
            produced.append(seq)
            if seq.finished:
                self.running.remove(seq)
                seq.release()
        return produced

    def run_to_completion(self, on_step: Callable[[list[Sequence]], None] | None = None) -> None:
        while self.has_work():
            produced = self.step()
            if on_step is not None:
                on_step(produced)

    def _forward(self, seq: Sequence, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.hybrid.gpu_device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kwarg: seq.cache})
        seq.cache = out["cache"] if "cache" in out else out["past_key_values"]
        return out.logits[0, -1]

    def _check_stop(self, seq: Sequence) -> None:
        token, params = seq.output_ids[-1], seq.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            seq.finish_reason = "stop"
            return
        if params.stop:
            text = self.detokenize(seq.output_ids)
            ends = [text.find(s) for s in params.stop if s in text]
            if ends:
                seq.stop_text_end = min(ends)
                seq.finish_reason = "stop"
                return
        if len(seq.output_ids) >= params.max_tokens:
            seq.finish_reason = "length"
        elif self.max_context is not None and seq.num_tokens >= self.max_context:
            seq.finish_reason = "length"
