"""The engine: a step function that advances a batch of sequences by one forward pass each.

Sequences wait in a queue until admitted: at most `max_running` at once, and (when `max_total_tokens` is set)
only while the running sequences' prompts plus their max_tokens fit in that many tokens of KV cache. In a step
every decoding sequence feeds its last token, and prefilling sequences feed prompt chunks, oldest first, sharing
`prefill_chunk` tokens per step (so a long prompt is prefilled over several steps and never stalls running
decodes by more than one chunk). Each sequence keeps its own KV cache and positions. Where the model allows it
(tiermoe.engine.batched_decode), all sequences that feed one token go through ONE model forward as a padded batch;
prefill chunks (and every sequence of a model that does not allow it) run one forward each, on their own threads.
The MoE blocks of all of those forwards run once per layer for the whole step (MoEBatcher). A sequence whose
prompt is complete samples one token.
The engine sees token ids only; text (stop strings) is reached through the `detokenize` function it is given.
Log-probabilities (tiermoe.engine.logprobs) come from the same logits: a sequence that asks for the prompt's keeps
every prefill position's logits, the others only the last.

One sequence's failure ends that sequence only (finish_reason "error", `seq.error`): a prompt id outside the
vocabulary is refused by `add`; a failed sampling or stop check fails its own sequence; a failed forward is
found again by re-running the step's sequences in halves on caches rolled back to where the step began
(tiermoe.engine.cache_rollback), down to the sequence(s) that fail alone. That does not depend on how a step
groups its sequences into forwards (one forward for all of them fails as a whole): the other sequences end the
step as if it had not failed, with the tokens they get alone.

With several ranks (tiermoe.distributed) rank 0's engine has a `leader`: every step it first publishes what it
is about to feed (sequence ids and tokens), and the other ranks run the same forwards with their own caches
(`forward_batch`, which groups the sequences the same way on every rank, so the MoE tokens line up); only rank 0
samples. A failed forward there leaves the ranks out of step for good (the leader raises a fatal error); a failed
sampling still fails its own sequence only.
"""

from __future__ import annotations

import inspect
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from tiermoe.config import MAX_RUNNING_REQUESTS
from tiermoe.engine.batched_decode import batched_decode_forward, can_join, decode_groups, supports_batched_decode
from tiermoe.engine.logprobs import logprobs_at
from tiermoe.engine.moe_batcher import MoEBatcher
from tiermoe.engine.sampling import SamplingParams, new_generator, sample
from tiermoe.engine.sequence import Sequence
from tiermoe.engine.step_isolation import forward_isolating
from tiermoe.errors import TiermoeError
from tiermoe.stats.pass_transaction import PassTransaction
from tiermoe.stats.recorders import RecorderGroup
from tiermoe.stats.recording import NO_RECORDER, ExpertRecorder, PassInfo


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 16  # sequences advanced together in one step (--max-running-requests)
    prefill_chunk: int = 512  # prompt tokens fed per step, over all prefilling sequences (--chunked-prefill-size)
    max_total_tokens: int | None = None  # KV tokens the running sequences may reserve (--max-total-tokens)

    def __post_init__(self):
        if not 1 <= self.max_running <= MAX_RUNNING_REQUESTS:  # the bound's reasons: tiermoe.config
            raise TiermoeError(f"max_running must be 1-{MAX_RUNNING_REQUESTS} sequences, got {self.max_running}")
        if self.prefill_chunk < 1:
            raise TiermoeError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise TiermoeError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")


class Engine:
    def __init__(self, hybrid, eos_token_ids: Iterable[int] = (), detokenize: Callable[[list[int]], str] | None = None,
                 config: EngineConfig = EngineConfig(), recorder: ExpertRecorder = NO_RECORDER):
        self.hybrid = hybrid
        self.model = hybrid.model
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.max_context = getattr(hybrid.config, "max_position_embeddings", None)
        self.vocab_size = _vocab_size(self.model)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self._batcher = MoEBatcher(config.max_running)
        for block in hybrid.blocks.values():
            block.batcher = self._batcher
        self.set_recorder(recorder)
        self.after_step_hooks: list[Callable[[], None]] = []  # e.g. dynamic placement landing its copies
        self.leader = None  # several ranks: publishes each step to the other ranks (tiermoe.distributed)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # Decided once per model: a padded batch of per-sequence caches is exact for full attention only.
        self.batched_decode = supports_batched_decode(self.model)

    def set_recorder(self, recorder: ExpertRecorder) -> None:
        """Route every pass's routed experts to `recorder` (call between steps); a pass that fails is not recorded
        (its re-run parts are)."""
        self.recorder = recorder
        self._pass = PassTransaction(recorder)
        for block in self.hybrid.blocks.values():
            block.recorder = self._pass

    def add_recorder(self, recorder: ExpertRecorder) -> None:
        """Add a recorder beside the current one(s)."""
        current = self.recorder
        if not current.enabled:
            self.set_recorder(recorder)
        elif isinstance(current, RecorderGroup):
            self.set_recorder(RecorderGroup(*current.members, recorder))
        else:
            self.set_recorder(RecorderGroup(current, recorder))

    def close(self) -> None:
        for block in self.hybrid.blocks.values():
            block.batcher = None
            block.recorder = NO_RECORDER
        self._batcher.close()

    def check_token_ids(self, ids: list[int], field: str = "prompt") -> None:
        """Refuse ids outside the model's vocabulary (on a GPU such an id would break the whole CUDA context)."""
        if self.vocab_size is None:
            return
        for position, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                shown = token if abs(token) < 2 ** 63 else "beyond 64 bits"  # str() of 5000 digits fails
                raise TiermoeError(f"{field}: token id {shown} at position {position} is outside the model's "
                                   f"vocabulary (0 to {self.vocab_size - 1})")

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; returns its Sequence (filled in as steps run)."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise TiermoeError("a prompt needs at least one token")
        self.check_token_ids(prompt_ids)
        if self.max_context is not None and len(prompt_ids) >= self.max_context:
            raise TiermoeError(f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_context}")
        if params.stop and self.detokenize is None:
            raise TiermoeError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        budget = self.config.max_total_tokens
        if budget is not None and len(prompt_ids) + params.max_tokens > budget:
            raise TiermoeError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                               f"max_total_tokens ({budget})")
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

    def reserved_tokens(self) -> int:
        return sum(len(s.prompt_ids) + s.params.max_tokens for s in self.running)

    def _admit(self) -> None:
        budget = self.config.max_total_tokens
        while self.waiting and len(self.running) < self.config.max_running:
            need = len(self.waiting[0].prompt_ids) + self.waiting[0].params.max_tokens
            if budget is not None and self.running and self.reserved_tokens() + need > budget:
                break
            self.running.append(self.waiting.popleft())

    def _schedule(self) -> list[tuple[Sequence, list[int]]]:
        """This step's (sequence, tokens to feed): every decode, and prompt chunks within the prefill budget."""
        budget, batch = self.config.prefill_chunk, []
        for seq in self.running:
            if seq.prefilling:
                if budget == 0:
                    continue
                tokens = seq.next_input(budget)
                budget -= len(tokens)
            else:
                tokens = seq.next_input(1)
            batch.append((seq, tokens))
        return batch

    def step(self) -> list[Sequence]:
        """One forward pass for every scheduled sequence; returns those that produced a token this step, and those
        that failed in it (finish_reason "error")."""
        self._admit()
        scheduled = self._schedule()
        if not scheduled:
            return []
        batch = [seq for seq, _ in scheduled]
        inputs = [tokens for _, tokens in scheduled]
        logits, errors = self._forward_isolating(batch, inputs)
        for hook in self.after_step_hooks:
            hook()
        produced = []
        for i, (seq, fed) in enumerate(zip(batch, inputs)):
            if i in errors:
                self._fail(seq, errors[i])
                produced.append(seq)
                continue
            start, seq.num_fed = seq.num_fed, seq.num_fed + len(fed)
            try:
                if seq.params.prompt_logprobs is not None and start < len(seq.prompt_ids):
                    # row r of the chunk's logits predicts prompt token start + r + 1
                    scored = seq.prompt_ids[start + 1:start + len(fed) + 1]
                    seq.prompt_logprobs += logprobs_at(logits[i], scored, seq.params.prompt_logprobs)
                if seq.prefilling:
                    continue
                self._next_token(seq, logits[i][-1])
            except Exception as err:  # noqa: BLE001 - this sequence's scoring, sampling or stop check: it alone fails
                self._fail(seq, err)
            produced.append(seq)
            if seq.finished and seq in self.running:
                self.running.remove(seq)
                seq.release()
        return produced

    def _next_token(self, seq: Sequence, logits_V: torch.Tensor) -> None:
        """Sample the sequence's next token (with its logprob when asked) and check whether it stops there; on an
        error the sequence is left as it was."""
        if seq.params.max_tokens == 0:  # the prompt only was to be scored
            seq.finish_reason = "length"
            return
        token = sample(logits_V, seq.params, seq.generator)
        scored = [] if seq.params.logprobs is None else logprobs_at(logits_V[None], [token], seq.params.logprobs)
        seq.output_ids.append(token)
        seq.output_logprobs += scored
        try:
            self._check_stop(seq)
        except BaseException:
            del seq.output_ids[-1], seq.output_logprobs[len(seq.output_ids):]
            raise

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        seq.fail(err)
        if seq in self.running:
            self.running.remove(seq)
        seq.release()

    def _forward_isolating(self, batch: list[Sequence],
                           inputs: list[list[int]]) -> tuple[list[torch.Tensor | None], dict[int, BaseException]]:
        """The step's forwards: (each sequence's logits, {index: error} of the sequences that failed); a failed
        step is traced to its sequences by tiermoe.engine.step_isolation."""
        if self.leader is not None:  # the other ranks ran this step's forwards: no re-running it on rank 0 alone
            with self.leader.step([s.seq_id for s in batch], inputs, [s.seq_id for s in self.running]):
                return self._recorded_forward(batch, inputs), {}
        return forward_isolating(self._recorded_forward, batch, inputs)

    def _recorded_forward(self, batch: list[Sequence], inputs: list[list[int]]) -> list[torch.Tensor]:
        groups = self._groups(batch, inputs)
        if self.recorder.enabled:
            # the MoE blocks see the rows in the groups' order (batched decodes first): the pass lists them so
            order = _row_order(*groups)
            self._pass.begin_pass(PassInfo(
                request_ids=tuple(batch[i].seq_id for i in order), num_tokens=tuple(len(inputs[i]) for i in order),
                start_positions=tuple(batch[i].num_fed for i in order),
                is_prefill=tuple(batch[i].prefilling for i in order)))
        try:
            logits = self._forward_groups(batch, inputs, *groups, rows={i: _rows_needed(s, len(inputs[i]))
                                                                        for i, s in enumerate(batch)})
        except BaseException:
            self._pass.discard()
            raise
        if self.recorder.enabled:
            self._pass.commit()
        return logits

    def forward_batch(self, seqs: list, inputs: list[list[int]]) -> list[torch.Tensor]:
        """Feed inputs[i] to seqs[i] (each on its own cache, `seq.cache`); MoE blocks run once for all of them.

        Sequences feeding one token share batched forwards (when the model allows it; rows of similar cache
        lengths together, see decode_groups); the rest run one forward each. Returns each sequence's last-position
        logits [1, V], in order. Does not advance `num_fed` (the caller does).
        """
        return self._forward_groups(seqs, inputs, *self._groups(seqs, inputs))

    def _forward_groups(self, seqs: list, inputs: list[list[int]], batches: list[list[int]], alone: list[int],
                        rows: dict[int, str] | None = None) -> list[torch.Tensor]:
        """Each sequence's logits [T, V]: by `rows` (see _rows_needed; "last" when not given), T = 1 (the last
        position), every fed position, or none."""
        rows = rows or {}
        jobs = [lambda b=b: self._forward_decode([seqs[i] for i in b], [inputs[i][0] for i in b]) for b in batches]
        jobs += [lambda i=i: [self._forward(seqs[i], inputs[i], rows.get(i, "last"))] for i in alone]
        results = [logits for job_logits in self._batcher.run(jobs) for logits in job_logits]
        logits_in_order: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
        for i, logits in zip(_row_order(batches, alone), results):
            logits_in_order[i] = logits
        return logits_in_order

    def _groups(self, seqs: list, inputs: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """(batches of indices that share one batched decode forward each, indices that run one forward each).
        The MoE blocks see the rows in this order: each batch's rows, then each other sequence's. It depends only
        on the inputs and the cache lengths, so every rank of a multi-rank run groups a step the same way."""
        batches = decode_batches(seqs, inputs) if self.batched_decode else []
        batched = {i for b in batches for i in b}
        return batches, [i for i in range(len(seqs)) if i not in batched]

    def run_to_completion(self, on_step: Callable[[list[Sequence]], None] | None = None) -> None:
        while self.has_work():
            produced = self.step()
            if on_step is not None:
                on_step(produced)

    def _forward(self, seq, tokens: list[int], rows: str = "last") -> torch.Tensor:
        """Feed `tokens` to one sequence; its logits [T, V] for `rows`: "last", "all" or "none" (T = 0)."""
        device = self.hybrid.gpu_device
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        keep = {"last": 1, "all": 0}.get(rows)
        if keep is None:  # an empty index: the LM head runs on no row at all
            keep = torch.empty(0, dtype=torch.long, device=device)
        with torch.inference_mode(), _on_device(device):
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{self._cache_kwarg: seq.cache})
        seq.cache = out["cache"] if "cache" in out else out["past_key_values"]
        return out.logits[0]

    def _forward_decode(self, seqs: list, tokens: list[int]) -> list[torch.Tensor]:
        """One forward for all `seqs`, one token each; each sequence's cache grows in place."""
        device = self.hybrid.gpu_device
        with torch.inference_mode(), _on_device(device):
            rows = batched_decode_forward(self.model, [s.cache for s in seqs], tokens, device, self._cache_kwarg)
        return [logits_V[None] for logits_V in rows]  # [V] -> [1, V], as every forward returns

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


def decode_batches(seqs: list, inputs: list[list[int]]) -> list[list[int]]:
    """Batches (indices into seqs) of sequences that share one batched decode forward each: one token in, a cache
    to extend, past lengths close enough for little padding (decode_groups)."""
    rows = [i for i, (seq, tokens) in enumerate(zip(seqs, inputs)) if len(tokens) == 1 and can_join(seq.cache)]
    if len(rows) < 2:
        return []
    return [[rows[j] for j in group] for group in decode_groups([seqs[i].cache.get_seq_length() for i in rows])]


def _rows_needed(seq: Sequence, fed: int) -> str:
    """The logits a step needs of `seq` feeding `fed` tokens: every row to score the prompt, none for a prefill
    chunk that does not end the prompt (its last row would be thrown away: a whole LM-head pass, 150k-wide on
    real vocabularies), else the last row to sample from."""
    if seq.scores_prompt:
        return "all"
    if seq.prefilling and seq.num_fed + fed < len(seq.prompt_ids):
        return "none"
    return "last"


def _vocab_size(model) -> int | None:
    """Rows of the input embedding (the ids a forward can look up); None when the model does not say."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    return int(rows) if rows is not None else getattr(getattr(model, "config", None), "vocab_size", None)


def _row_order(batches: list[list[int]], alone: list[int]) -> list[int]:
    """The order the MoE blocks see a step's rows in: each batch's rows, then each other sequence's."""
    return [i for b in batches for i in b] + alone


def _on_device(device: torch.device):
    # CUDA's current device is per thread, and forwards run on the batcher's threads: make it this model's
    # (cuda:LOCAL_RANK on rank > 0), so nothing the forward allocates implicitly lands on cuda:0.
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
