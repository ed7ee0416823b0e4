"""The engine: a step function that advances a batch of sequences by ONE forward pass over a shared KV pool.

Sequences wait in a queue until admitted: at most `max_running` at once, and only while the pool has pages for
their next tokens. In a step every decoding sequence feeds its last token, and prefilling sequences feed prompt
chunks, sharing `prefill_chunk` tokens per step fairly (tiermoe.engine.fair_share: so a long prompt is
prefilled over several steps, never stalls running decodes by more than one chunk, and never holds a new short
prompt back). All of them go through one model forward as a ragged
batch (tiermoe.layers.ragged_step): the decode rows and each chunk's rows side by side, no padding of the batch,
every new token's K/V written once into the pool (tiermoe.engine.kv_pool) and the past read where it lies. The MoE
blocks therefore see the whole step's tokens at once. A sequence whose tokens are all through samples one token.
When the pool has no pages for a step, the most recently admitted sequences are preempted: their pages go back,
they wait at the head of the queue with their tokens and sampler state, and later recompute their K/V (prompt and
output so far, as chunks) and go on exactly where they were.
The engine sees token ids only; text (stop strings) is reached through the `detokenize` function it is given.
Log-probabilities (tiermoe.engine.logprobs) come from the same logits: a sequence that asks for the prompt's keeps
every prefill position's logits, the others only the last.

One sequence's failure ends that sequence only (finish_reason "error", `seq.error`): a prompt id outside the
vocabulary is refused by `add`; a failed sampling or stop check fails its own sequence; a failed forward is
found again by re-running the step's sequences in halves (tiermoe.engine.step_isolation), down to the sequence(s)
that fail alone. Nothing needs rolling back for that: a step writes only positions its sequences have not fed yet,
and linear-attention states are committed only once the step's forward succeeded.

With several ranks (tiermoe.distributed) rank 0's engine has a `leader`: every step it first publishes what it
is about to feed (sequence ids, tokens and their page tables), and the other ranks run the same forward on their
own pools (`forward_feeds`); only rank 0 samples. A failed forward there leaves the ranks out of step for good (the
leader raises a fatal error); a failed sampling still fails its own sequence only.

Speculative decoding (EngineConfig.speculative; off by default): a decoding sequence may feed its last token and
k drafted ones (tiermoe.engine.speculative_drafting) as one segment of the step, like a prompt chunk after a past,
with every row's logits kept. Row j is the distribution of the token after the first j drafts; the tokens are
taken row by row (tiermoe.engine.speculative_verify: greedy rows take the argmax, sampled rows accept a draft by
rejection sampling, which keeps the target distribution), each through the same stop checks as a plain step, up to
the first rejected draft, whose row gives the replacement, or past the last draft, whose row gives one token more.
Then `num_fed` goes back to `num_tokens - 1`: the rejected positions' K/V stay in the pages but are never read
(attention masks everything after a query's position, and the next step writes there first) and sliding-window
pages are trimmed only after that. Linear-attention layers keep their state after each verified position
(tiermoe.layers.linear_attention_slots), and the next step continues from the last kept one. Drafts take the
step's token budget that prompt chunks leave, so the step buffers bound them too.
A drafter with a model of its own (MTP: tiermoe.engine.speculative_mtp) adds its layer to the pool, is told each
forward's rows and each finished step, and keeps its K/V at the positions the sequences keep.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from tiermoe.config import DEFAULT_PAGE_SIZE, MAX_RUNNING_REQUESTS
from tiermoe.engine.device_errors import device_lost, sticky_device_error
from tiermoe.engine.fair_share import request_over_share, scored_rows_budget, share_prefill_budget
from tiermoe.engine.incremental_text import IncrementalText, find_stop
from tiermoe.engine.kv_pool import KVPool
from tiermoe.engine.logits_processing import LogitsAdjuster
from tiermoe.engine.logprobs import logprobs_at
from tiermoe.engine.pool_size import auto_pool_tokens
from tiermoe.engine.sampling import Grammar, SamplingParams, new_generator, sample
from tiermoe.engine.sequence import Sequence
from tiermoe.engine.speculative_config import SpeculativeConfig
from tiermoe.engine.speculative_drafting import step_cost_of
from tiermoe.engine.speculative_mtp import make_drafter
from tiermoe.engine.speculative_timing import MeasuredStepCost
from tiermoe.engine.speculative_verify import verify_token
from tiermoe.engine.step_isolation import forward_isolating
from tiermoe.engine.structured_output import CompiledGrammar, GrammarState
from tiermoe.errors import TiermoeError
from tiermoe.experts.threads import torch_threads
from tiermoe.layers.linear_attention_slots import use_ragged_linear_attention
from tiermoe.layers.paged_attention import STEP_KWARG, PagedStepCache, layer_windows, use_paged_attention
from tiermoe.layers.ragged_step import SeqFeed
from tiermoe.model.served_adapters import DEFAULT_MAX_LOADED, LoadedAdapter, ServedAdapters
from tiermoe.stats.pass_transaction import PassTransaction
from tiermoe.stats.recorders import RecorderGroup
from tiermoe.stats.recording import NO_RECORDER, ExpertRecorder, PassInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 16  # sequences advanced together in one step (--max-running-requests)
    prefill_chunk: int = 512  # prompt tokens fed per step, over all prefilling sequences (--chunked-prefill-size)
    max_total_tokens: int | None = None  # tokens the KV pool holds (--max-total-tokens); None: sized from memory
    page_size: int = DEFAULT_PAGE_SIZE  # tokens per KV page (--page-size)
    prefix_cache: bool = True  # reuse the pages of a prompt's known prefix (--no-prefix-cache turns it off)
    speculative: SpeculativeConfig | None = None  # speculative decoding (--speculative-algorithm); None: off

    def __post_init__(self):
        if not 1 <= self.max_running <= MAX_RUNNING_REQUESTS:  # the bound's reasons: tiermoe.config
            raise TiermoeError(f"max_running must be 1-{MAX_RUNNING_REQUESTS} sequences, got {self.max_running}")
        if self.prefill_chunk < 1:
            raise TiermoeError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise TiermoeError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if not 1 <= self.page_size <= 1024:
            raise TiermoeError(f"page_size must be 1-1024 tokens, got {self.page_size}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise TiermoeError(f"speculative must be a SpeculativeConfig, got {type(self.speculative).__name__}")


class Engine:
    def __init__(self, hybrid, eos_token_ids: Iterable[int] = (), detokenize: Callable[[list[int]], str] | None = None,
                 config: EngineConfig = EngineConfig(), recorder: ExpertRecorder = NO_RECORDER,
                 detokenize_special: Callable[[list[int]], str] | None = None):
        self.hybrid = hybrid
        self.model = hybrid.model
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.detokenize_special = detokenize_special  # keeps special tokens (a sequence's skip_special_tokens False)
        # structured output: a Grammar compiled for this model's tokenizer (LLM.compile_grammar); None without one
        self.compile_grammar: Callable[[Grammar], CompiledGrammar] | None = None
        self.max_context = getattr(hybrid.config, "max_position_embeddings", None)
        self.vocab_size = _vocab_size(self.model)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self.set_recorder(recorder)
        self.after_step_hooks: list[Callable[[], None]] = []  # e.g. dynamic placement landing its copies
        self.leader = None  # several ranks: publishes each step to the other ranks (tiermoe.distributed)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        try:
            use_paged_attention(self.model)
        except ValueError as err:
            raise TiermoeError(str(err)) from None
        use_ragged_linear_attention(self.model)
        windows = layer_windows(self.model.config)
        self.drafter = None  # speculative decoding's drafts (None: off)
        if config.speculative is not None:
            cost = MeasuredStepCost(step_cost_of(hybrid))  # the bytes model until timed steps tell better
            self.drafter = make_drafter(config.speculative, cost, self.max_context, hybrid)
            if self.drafter.routing is not None:  # adaptive: its verify passes measure the lag reuse its lengths weigh
                self.add_recorder(self.drafter.routing)
            windows = self.drafter.pool_layers(windows)  # an MTP layer's K/V: one more layer of the pool
        device = hybrid.gpu_device
        tokens = config.max_total_tokens or auto_pool_tokens(self.model.config, self.model.dtype, windows,
                                                             config.max_running, self.max_context, device)
        # decode rows attend the pool in place where the model allows it (tiermoe.layers.decode_attention)
        self.decode_attention = getattr(hybrid, "decode_attention", None)
        self.pool = KVPool(windows, tokens, config.max_running, device, config.page_size, config.prefill_chunk,
                           config.prefix_cache, self.max_context)
        if self.drafter is not None:
            self.drafter.attach(self.pool)
        if config.prefix_cache and not self.pool.reuse_possible:
            log.info("prefix reuse is off for this model: its sliding-window or linear-attention layers keep no "
                     "state at page boundaries")
        self.prefix_hit_tokens = 0  # prompt tokens whose K/V came from the pool instead of a forward
        self.preemptions = 0  # sequences whose pages the pool took back
        self.adapters: ServedAdapters | None = None  # LoRA adapters served per request (serve_adapters)

    def serve_adapters(self, max_loaded: int = DEFAULT_MAX_LOADED) -> ServedAdapters:
        """The LoRA adapters this engine serves per request (made on the first call, with room for `max_loaded`):
        load them with `.load(name, merged_lora(...))`; a sequence asks for one by SamplingParams.adapter."""
        if self.adapters is None:
            self.adapters = ServedAdapters(self.hybrid, max_loaded)
        return self.adapters

    def adapter_in_use(self, adapter: LoadedAdapter) -> bool:
        """Whether a queued or running sequence runs with `adapter`."""
        return any(seq.adapter is adapter for seq in itertools.chain(self.waiting, self.running))

    def free_unused_adapters(self) -> None:
        """Give back the slots of unloaded (retired) adapters whose last sequence has ended (between steps)."""
        if self.adapters is None:
            return
        for adapter in [a for a in self.adapters.held if a.retired]:
            if not self.adapter_in_use(adapter):
                self.adapters.free(adapter)

    def set_recorder(self, recorder: ExpertRecorder) -> None:
        """Route every pass's routed experts to `recorder` (call between steps); a pass that fails is not recorded
        (its re-run parts are)."""
        self.recorder = recorder
        self._pass = PassTransaction(recorder)
        for block in self.hybrid.blocks.values():
            block.recorder = self._pass

    def add_recorder(self, recorder: ExpertRecorder) -> None:
        """Add a recorder beside the current one(s) (recording now or not: a recorder turns on and off)."""
        current = self.recorder
        if current is NO_RECORDER:
            self.set_recorder(recorder)
        elif isinstance(current, RecorderGroup):
            self.set_recorder(RecorderGroup(*current.members, recorder))
        else:
            self.set_recorder(RecorderGroup(current, recorder))

    def close(self) -> None:
        for block in self.hybrid.blocks.values():
            block.recorder = NO_RECORDER
        if self.drafter is not None:
            self.drafter.close()

    def check_token_ids(self, ids: list[int], field: str = "prompt") -> None:
        """Refuse ids outside the model's vocabulary (on a GPU such an id would break the whole CUDA context)."""
        if self.vocab_size is None:
            return
        for position, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                shown = token if abs(token) < 2 ** 63 else "beyond 64 bits"  # str() of 5000 digits fails
                raise TiermoeError(f"{field}: token id {shown} at position {position} is outside the model's "
                                   f"vocabulary (0 to {self.vocab_size - 1})")

    def add(self, prompt_ids: list[int], params: SamplingParams, group: int | None = None) -> Sequence:
        """Queue a request; returns its Sequence (filled in as steps run). `group`: the request it is one prompt of
        (a batch); admission takes turns between requests."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise TiermoeError("a prompt needs at least one token")
        self.check_token_ids(prompt_ids)
        if self.max_context is not None and len(prompt_ids) >= self.max_context:
            raise TiermoeError(f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_context}")
        if params.stop and self.detokenize is None:
            raise TiermoeError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        self.check_token_ids(list(params.stop_token_ids), "stop_token_ids")
        self.check_token_ids([t for t, _ in params.logit_bias], "logit_bias")
        grammar = self._grammar_state(params.grammar)
        adapter = self._adapter(params.adapter)
        capacity = self.pool.tokens
        if len(prompt_ids) + params.max_tokens > capacity:
            raise TiermoeError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                               f"the KV pool's {capacity} tokens (max_total_tokens)")
        seq = Sequence(next(self._ids), prompt_ids, params, new_generator(params.seed), pages=self.pool.new_share(),
                       group=group, grammar=grammar, adapter=adapter)
        self.waiting.append(seq)
        return seq

    def _adapter(self, name: str | None) -> LoadedAdapter | None:
        if name is None:
            return None
        if self.adapters is None:
            raise TiermoeError(f"there is no LoRA adapter {str(name)[:80]!r}: this engine serves none per request")
        return self.adapters.get(name)

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence now and free its pages (a client went away)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.finish_reason = seq.finish_reason or "abort"
        self._release(seq)
        self.free_unused_adapters()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        """Admit waiting sequences while a slot is free and the pool has pages for their first chunk: preempted
        ones first (they wait at the head of the queue), then round-robin across requests (the oldest sequence of
        the request with the fewest running), so a lone request is admitted before the rest of a big batch. With
        every slot taken, a request over its fair share gives one back to a request that has none
        (tiermoe.engine.fair_share)."""
        running_of = Counter(s.request for s in self.running)
        while self.waiting:
            seq = self.waiting[0]
            if len(self.running) >= self.config.max_running:
                over = request_over_share(running_of, (s.request for s in self.waiting), self.config.max_running)
                if over is None:
                    break
                victim = next(s for s in reversed(self.running) if s.request == over)  # its latest admitted
                self._preempt(victim, at_head=False)  # behind the newcomers: it waits its turn, round-robin
                running_of[over] -= 1
                seq = next(s for s in self.waiting if running_of[s.request] == 0)  # the slot is a newcomer's
            elif not seq.preemptions:  # (those preempted for the pool wait at the head, to go on first)
                seq = min(self.waiting, key=lambda s: running_of[s.request])
            if seq.num_fed == 0 and seq.params.prompt_logprobs is None:  # logprobs need every prompt row computed
                seq.num_fed = self.pool.match(seq.pages, seq.known_ids, seq.num_tokens - 1, seq.prefix_salt)
                self.prefix_hit_tokens += seq.num_fed
            if not self.pool.reserve(seq.pages, seq.num_fed,
                                     seq.num_fed + min(seq.num_tokens - seq.num_fed, self.config.prefill_chunk)):
                self._release(seq)  # a waiting sequence holds no pages: the matched ones stay findable, idle
                seq.num_fed = 0
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            running_of[seq.request] += 1

    def _schedule(self) -> list[tuple[Sequence, list[int]]]:
        """This step's (sequence, tokens to feed): every decode, and prompt chunks within the prefill budget; each
        with its pages reserved (preempting the most recently admitted sequences when the pool is full)."""
        prefilling = [seq for seq in self.running if seq.prefilling]
        scoring = [seq for seq in prefilling if seq.scores_prompt]
        rows = share_prefill_budget([seq.num_tokens - seq.num_fed for seq in scoring],  # rows of logits: decode-first
                                    scored_rows_budget(len(self.running) - len(prefilling), self.config.max_running))
        rows_of = {seq.seq_id: n for seq, n in zip(scoring, rows)}
        needs = [rows_of.get(seq.seq_id, seq.num_tokens - seq.num_fed) for seq in prefilling]
        shares = share_prefill_budget(needs, self.config.prefill_chunk)
        share_of = {seq.seq_id: share for seq, share in zip(prefilling, shares)}
        drafts = self._drafts(self.config.prefill_chunk - sum(shares), sum(shares))
        batch, preempted = [], set()
        for seq in list(self.running):
            if seq.seq_id in preempted:  # preempted for an earlier sequence of this step
                continue
            if seq.prefilling:
                if share_of[seq.seq_id] == 0:
                    continue
                tokens = seq.next_input(share_of[seq.seq_id])
            else:
                tokens = seq.next_input(1)
            while not self.pool.reserve(seq.pages, seq.num_fed, seq.num_fed + len(tokens)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(victim.seq_id)
                batch = [(s, t) for s, t in batch if s is not victim]
                if victim is seq:
                    break
            else:
                batch.append((seq, tokens))
        for j, (seq, tokens) in enumerate(batch):  # drafts take only the pages every scheduled feed left free
            draft = drafts.get(seq.seq_id)
            if draft and not seq.prefilling and self.pool.reserve(seq.pages, seq.num_fed,
                                                                   seq.num_fed + 1 + len(draft)):
                batch[j], seq.draft = (seq, tokens + draft), draft
        return batch

    def _drafts(self, budget: int, chunk_tokens: int) -> dict[int, list[int]]:
        """seq_id -> the drafted tokens each decoding sequence verifies this step (speculative decoding), within
        `budget` tokens in all; `chunk_tokens`: the step's prompt-chunk tokens (the cost model weighs them)."""
        for seq in self.running:
            seq.draft = []
        if self.drafter is None or budget < 1:
            return {}
        return self.drafter.drafts([s for s in self.running if not s.prefilling], budget, chunk_tokens)

    def _preempt(self, seq: Sequence, at_head: bool = True) -> None:
        """Give `seq`'s pages back and queue it (first, unless it gives its slot to a fairer turn); it recomputes
        its K/V when admitted again."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_fed = 0
        seq.draft = []
        seq.preemptions += 1
        self.preemptions += 1
        if at_head:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def step(self) -> list[Sequence]:
        """One forward pass for every scheduled sequence; returns those that produced a token this step, and those
        that failed in it (finish_reason "error")."""
        # sampling too: torch's workers, woken by an argmax over the vocabulary, would spin on the team's cores
        with torch_threads(self.hybrid.torch_threads):
            return self._step()

    def _step(self) -> list[Sequence]:
        started = time.perf_counter()  # speculative decoding's measured cost: the whole step, drafting included
        self._admit()
        scheduled = self._schedule()
        if not scheduled:
            return []
        batch = [seq for seq, _ in scheduled]
        inputs = [tokens for _, tokens in scheduled]
        shape = self.drafter.step_shape(batch, inputs) if self.drafter is not None else None
        logits, errors = self._forward_isolating(batch, inputs)
        for hook in self.after_step_hooks:
            hook()
        produced, biases = [], self._grammar_biases(batch, inputs, logits)
        for i, (seq, fed) in enumerate(zip(batch, inputs)):
            drafted, seq.draft = seq.draft, []
            if i in errors:
                self._fail(seq, errors[i])
                produced.append(seq)
                continue
            start, seq.num_fed = seq.num_fed, seq.num_fed + len(fed)
            if not drafted:  # a verify step trims once it knows how many positions it keeps
                self.pool.trim(seq.pages, seq.num_fed)
            try:
                if drafted:
                    self._verify(seq, drafted, logits[i])
                else:
                    self._score_prompt(seq, start, len(fed), logits[i])
                    if seq.num_fed < seq.num_tokens:  # a chunk: its sequence's tokens are not all through yet
                        continue
                    self._next_token(seq, logits[i][-1], biases.get(i))
            except Exception as err:  # noqa: BLE001 - this sequence's scoring, sampling or stop check: it alone fails
                sticky = sticky_device_error(err)  # an asynchronous CUDA fault surfaces at the sampler's sync
                if sticky is not None:
                    raise device_lost(sticky) from err
                self._fail(seq, err)
            produced.append(seq)
            if seq.finished and seq in self.running:
                self.running.remove(seq)
                self._release(seq)
        if self.drafter is not None:
            self.drafter.stepped(batch)  # an MTP drafter's layer extends over the kept positions
        if shape is not None and not errors:
            self.drafter.observe(shape, time.perf_counter() - started)
        self.free_unused_adapters()
        return produced

    def _score_prompt(self, seq: Sequence, start: int, fed: int, logits_TV: torch.Tensor) -> None:
        """Prompt logprobs of the prompt tokens this chunk predicts that are not scored yet (a preempted sequence
        recomputes positions it has scored before)."""
        if seq.params.prompt_logprobs is None:
            return
        first = len(seq.prompt_logprobs) + 1  # prompt token the next score is for
        last = min(start + fed, len(seq.prompt_ids) - 1)  # row r of the chunk predicts token start + r + 1
        if first <= last and first > start:
            rows = logits_TV[first - start - 1:last - start]
            seq.prompt_logprobs += logprobs_at(rows, seq.prompt_ids[first:last + 1], seq.params.prompt_logprobs)

    def _verify(self, seq: Sequence, drafted: list[int], logits_TV: torch.Tensor) -> None:
        """Take `seq`'s tokens from a verify step's rows [len(drafted) + 1, V]: row j decides the token after the
        first j drafts, until one is rejected (its row's token replaces it), the sequence stops, or every draft is
        taken (the last row gives one more). Then only the positions of kept tokens count as fed."""
        accepted = 0
        try:
            for j, row in enumerate(logits_TV):
                draft = drafted[j] if j < len(drafted) else None
                token = self._next_token(seq, row, None, draft)
                if draft is None or token != draft or seq.finished:
                    break
                accepted += 1
        finally:
            self.drafter.record(seq, len(drafted), accepted)
            seq.num_fed = min(seq.num_fed, seq.num_tokens - 1)  # the rejected positions are given back
            self.pool.trim(seq.pages, seq.num_fed)
            self.pool.shrink(seq.pages, seq.num_fed + 1)  # and their pages, but the one the next token goes to

    def _next_token(self, seq: Sequence, logits_V: torch.Tensor, grammar_bias_V: torch.Tensor | None,
                    draft: int | None = None) -> int | None:
        """Sample the sequence's next token (with its logprob when asked) and check whether it stops there; on an
        error the sequence is left as it was. `grammar_bias_V`: its grammar's mask (0 or -inf), when it has one.
        `draft`: a drafted token this position verifies (accepted or replaced: tiermoe.engine.speculative_verify).
        Returns the token (None when the prompt only was scored)."""
        if seq.params.max_tokens == 0:  # the prompt only was to be scored
            seq.finish_reason = "length"
            return None
        logits = self._adjusted(seq, logits_V)
        if seq.grammar is not None:  # masked on a copy: the logprobs are the model's own
            logits = (logits.clone() if logits is logits_V else logits).add_(grammar_bias_V)
        token = sample(logits, seq.params, seq.generator) if draft is None else verify_token(
            logits, seq.params, seq.generator, draft)
        scored = [] if seq.params.logprobs is None else logprobs_at(logits_V[None], [token], seq.params.logprobs)
        if seq.grammar is not None and not seq.grammar.accept(token):
            raise TiermoeError(f"token {token} was sampled outside the grammar (all its tokens had -inf logits)")
        seq.output_ids.append(token)
        seq.output_logprobs += scored
        try:
            self._check_stop(seq)
        except BaseException:
            del seq.output_ids[-1], seq.output_logprobs[len(seq.output_ids):]
            if seq.grammar is not None:
                seq.grammar.rollback(1)
            raise
        if seq.grammar is not None and seq.grammar.finished and not seq.finished:
            seq.finish_reason = "stop"  # the reply is complete: the grammar allows nothing but EOS
        return token

    @staticmethod
    def _grammar_biases(batch: list[Sequence], inputs: list[list[int]], logits: list[torch.Tensor]) -> dict:
        """Row -> the grammar's mask (0 or -inf) for the rows that sample this step and have a grammar, computed
        together: one pass for all of them costs about what one row's did (the per-call overhead dominates). A
        sequence with ignore_eos has EOS left out while its grammar allows any other token: sampled, EOS would
        complete the grammar and so end a sequence that asked to go on."""
        rows = [i for i, (seq, fed) in enumerate(zip(batch, inputs))
                if seq.grammar is not None and seq.num_fed + len(fed) >= seq.num_tokens]
        if not rows:
            return {}
        states = [batch[i].grammar for i in rows]
        masks = states[0].compiler.masks_bias(states, logits[rows[0]][-1],
                                              going_on=[batch[i].params.ignore_eos for i in rows])
        return dict(zip(rows, masks))

    def _grammar_state(self, grammar: Grammar | None) -> GrammarState | None:
        if grammar is None:
            return None
        if self.compile_grammar is None:
            raise TiermoeError(f"structured output ({grammar.kind}) needs the model's tokenizer; this model has none")
        return self.compile_grammar(grammar).new_state()

    def _adjusted(self, seq: Sequence, logits_V: torch.Tensor) -> torch.Tensor:
        """The logits `seq` samples from: the model's, or (penalties, logit_bias, min_tokens) a changed copy."""
        if not seq.params.adjusts_logits:
            return logits_V
        if seq.logits_adjuster is None:
            seq.logits_adjuster = LogitsAdjuster(seq.params, seq.prompt_ids, self.eos_token_ids)
        return seq.logits_adjuster.adjust(logits_V, seq.output_ids)

    def _fail(self, seq: Sequence, err: BaseException) -> None:
        seq.fail(err)
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Its pages go back to the pool (with prefix reuse, the full ones stay findable by their tokens)."""
        self.pool.release(seq.pages, seq.known_ids[:seq.num_fed], seq.prefix_salt)

    def _forward_isolating(self, batch: list[Sequence],
                           inputs: list[list[int]]) -> tuple[list[torch.Tensor | None], dict[int, BaseException]]:
        """The step's forward: (each sequence's logits, {index: error} of the sequences that failed); a failed
        step is traced to its sequences by tiermoe.engine.step_isolation."""
        if self.leader is not None:  # the other ranks ran this step's forward: no re-running it on rank 0 alone
            feeds, order = self._feeds(batch, inputs)
            with self.leader.step([batch[i].seq_id for i in order], [inputs[i] for i in order], feeds):
                return self._recorded_forward(batch, inputs), {}
        return forward_isolating(self._recorded_forward, batch, inputs)

    def _feeds(self, batch: list[Sequence], inputs: list[list[int]]) -> tuple[list[SeqFeed], list[int]]:
        """The step's feeds in row order (decode rows first, longest past first, so rows of similar lengths attend
        together: tiermoe.layers.ragged_step.decode_runs; then every other feed), and that order as indices into
        batch."""
        decode = sorted((i for i, s in enumerate(batch) if len(inputs[i]) == 1 and s.num_fed > 0),
                        key=lambda i: -batch[i].num_fed)
        decoding = set(decode)
        order = decode + [i for i in range(len(batch)) if i not in decoding]
        return [self.pool.feed(batch[i].pages, batch[i].num_fed, len(inputs[i]), bool(batch[i].draft))
                for i in order], order

    def _recorded_forward(self, batch: list[Sequence], inputs: list[list[int]]) -> list[torch.Tensor]:
        feeds, order = self._feeds(batch, inputs)
        routing = getattr(self.hybrid, "routing_override", None)  # routing replayed from a trace: told first
        if self.recorder.enabled or routing is not None:  # the MoE blocks see the rows in the step's row order
            info = PassInfo(
                request_ids=tuple(batch[i].seq_id for i in order), num_tokens=tuple(len(inputs[i]) for i in order),
                start_positions=tuple(batch[i].num_fed for i in order),
                is_prefill=tuple(batch[i].prefilling for i in order),
                input_ids=tuple(t for i in order for t in inputs[i]))
            if self.recorder.enabled:
                self._pass.begin_pass(info)
            if routing is not None:
                routing.begin_pass(info, self)
        try:
            logits = self.forward_feeds(feeds, [inputs[i] for i in order],
                                        [_rows_needed(batch[i], len(inputs[i])) for i in order],
                                        [batch[i].adapter_slot for i in order])
        except BaseException:
            self._pass.discard()
            raise
        finally:
            if routing is not None:
                routing.end_pass()
        if self.recorder.enabled:
            self._pass.commit()
        if self.drafter is not None:
            self.drafter.forwarded([batch[i] for i in order], [inputs[i] for i in order])
        return _in_order(logits, order)

    def new_sequence(self, prompt_ids: list[int] = (0,)) -> Sequence:
        """A sequence outside the scheduler, for driving by hand with `feed` (benchmarks, tests); `release` it."""
        return Sequence(next(self._ids), list(prompt_ids), SamplingParams(), new_generator(None),
                        pages=self.pool.new_share())

    def feed(self, seqs: list[Sequence], inputs: list[list[int]], rows: list[str] | None = None) -> list[torch.Tensor]:
        """Feed inputs[i] to seqs[i] in one forward now, outside the scheduler (pages reserved, `num_fed`
        advanced); each sequence's logits as `forward_feeds` gives them, in the order given."""
        for seq, tokens in zip(seqs, inputs):
            if self.max_context is not None and seq.num_fed + len(tokens) > self.max_context:
                raise TiermoeError(f"sequence {seq.seq_id} would hold {seq.num_fed + len(tokens)} tokens; the model's "
                                   f"context is {self.max_context}")
        self.pool.step_buffers.check(len(seqs), sum(len(tokens) for tokens in inputs))  # before taking any page
        for seq, tokens in zip(seqs, inputs):
            if not self.pool.reserve(seq.pages, seq.num_fed, seq.num_fed + len(tokens)):
                raise TiermoeError(f"the KV pool has no pages left for {len(tokens)} more tokens")
        feeds, order = self._feeds(seqs, inputs)
        rows = rows or ["last"] * len(seqs)
        logits = self.forward_feeds(feeds, [inputs[i] for i in order], [rows[i] for i in order],
                                    [seqs[i].adapter_slot for i in order])
        for i in order:
            seqs[i].num_fed += len(inputs[i])
            self.pool.trim(seqs[i].pages, seqs[i].num_fed)
        return _in_order(logits, order)

    def release(self, seq: Sequence) -> None:
        """Hand a sequence's pages back to the pool."""
        self.pool.release(seq.pages)

    def forward_feeds(self, feeds: list[SeqFeed], inputs: list[list[int]], rows: list[str] | None = None,
                      slots: list[int] | None = None) -> list[torch.Tensor]:
        """ONE forward feeding inputs[i] to the sequence of feeds[i] (the decode rows first: one token after a
        past), on this engine's pool; commits their linear-attention states when it succeeds. Returns each
        sequence's logits [T_i, V] (fp32, on the host) for `rows[i]` ("last" when not given: T_i = 1; "all": every
        fed position; "none": T_i = 0). `slots[i]`: the adapter slot feed i runs with (Sequence.adapter_slot; none
        given: every feed without one). Does not advance any sequence (the caller does)."""
        # the step's setup and its logits' copy too: an op at more threads wakes torch's OpenMP workers, which then
        # spin on the kernel team's cores through the next steps (as in `step`)
        with torch_threads(self.hybrid.torch_threads):
            if self.adapters is None or not any(slots or ()):
                return self._forward_feeds(feeds, inputs, rows)
            self.adapters.rows.begin([slot for slot, fed in zip(slots, inputs) for _ in fed])
            try:
                return self._forward_feeds(feeds, inputs, rows)
            finally:
                self.adapters.rows.end()

    def _forward_feeds(self, feeds: list[SeqFeed], inputs: list[list[int]],
                       rows: list[str] | None) -> list[torch.Tensor]:
        device = self.hybrid.gpu_device
        rows = rows or ["last"] * len(feeds)
        num_decode = next((i for i, f in enumerate(feeds) if not (f.new == 1 and f.past > 0)), len(feeds))
        step = self.pool.step(feeds, self.model.dtype, num_decode, self.decode_attention)
        buffers = self.pool.step_buffers  # the step's tensors, at the same addresses every step
        ids = buffers.stage("input_ids", torch.tensor([[t for tokens in inputs for t in tokens]], dtype=torch.long))
        keep, spans = _kept_rows(feeds, rows)
        keep_rows = buffers.stage("logits_to_keep", torch.tensor(keep, dtype=torch.long))
        with torch.inference_mode(), _on_device(device):
            cache = PagedStepCache(self.pool.pages, step, self.pool.linear)
            out = self.model(input_ids=ids, position_ids=step.position_ids, attention_mask=_NO_MASK,
                             use_cache=True, logits_to_keep=keep_rows, **{self._cache_kwarg: cache, STEP_KWARG: step})
        self.pool.commit(feeds)
        logits = out.logits[0]
        if keep:  # every kept row to the host in ONE copy (one wait per step): sampling and logprobs read them there
            logits = logits.float().to("cpu")
        return [logits[a:b] for a, b in spans]

    def run_to_completion(self, on_step: Callable[[list[Sequence]], None] | None = None) -> None:
        while self.has_work():
            produced = self.step()
            if on_step is not None:
                on_step(produced)

    def decoded_text(self, seq: Sequence) -> IncrementalText:
        """`seq`'s output text, decoded as it grows (made on first use; its stop strings are searched in it), with
        its special tokens kept when its params say skip_special_tokens False."""
        if seq.decoded is None:
            keep_special = not seq.params.skip_special_tokens and self.detokenize_special is not None
            seq.decoded = IncrementalText(self.detokenize_special if keep_special else self.detokenize)
        return seq.decoded

    def _check_stop(self, seq: Sequence) -> None:
        token, params = seq.output_ids[-1], seq.params
        stops = len(seq.output_ids) >= params.min_tokens  # before min_tokens nothing but the length ends it (vLLM)
        if stops and ((token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids):
            seq.finish_reason = "stop"
            return
        if params.stop:
            decoded = self.decoded_text(seq)
            added = decoded.update(seq.output_ids)  # grown every step: a match ending before min_tokens is skipped
            found = find_stop(decoded.text, len(added), params.stop) if stops else None
            if found is not None:
                seq.stop_text_end, seq.stop_string = found
                seq.finish_reason = "stop"
                return
        if len(seq.output_ids) >= params.max_tokens:
            seq.finish_reason = "length"
        elif self.max_context is not None and seq.num_tokens >= self.max_context:
            seq.finish_reason = "length"


# A ready-made 4-D mask: transformers then builds none of its own (each attention part gets the step's masks).
_NO_MASK = torch.zeros(1, 1, 0, 0)


def _in_order(rows: list, order: list[int]) -> list:
    """rows[k] belongs to index order[k]: the rows by index."""
    out = [None] * len(rows)
    for row, i in zip(rows, order):
        out[i] = row
    return out


def _kept_rows(feeds: list[SeqFeed], rows: list[str]) -> tuple[list[int], list[tuple[int, int]]]:
    """(the step's rows the LM head runs on, each feed's [start, end) among them)."""
    keep, spans, first = [], [], 0
    for feed, wanted in zip(feeds, rows):
        mine = {"last": [first + feed.new - 1], "all": list(range(first, first + feed.new)), "none": []}[wanted]
        spans.append((len(keep), len(keep) + len(mine)))
        keep += mine
        first += feed.new
    return keep, spans


def _rows_needed(seq: Sequence, fed: int) -> str:
    """The logits a step needs of `seq` feeding `fed` tokens: every row to score the prompt, none for a chunk
    that does not bring the sequence's tokens to their end (its last row would be thrown away: a whole LM-head
    pass, 150k-wide on real vocabularies), else the last row to sample from; every row of a verify step."""
    if seq.scores_prompt or seq.draft:  # a verify step: every drafted position's distribution
        return "all"
    if seq.num_fed + fed < seq.num_tokens:
        return "none"
    return "last"


def _vocab_size(model) -> int | None:
    """Rows of the input embedding (the ids a forward can look up); None when the model does not say."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    return int(rows) if rows is not None else getattr(getattr(model, "config", None), "vocab_size", None)


def _on_device(device: torch.device):
    # CUDA's current device is per thread: make it this model's (cuda:LOCAL_RANK on rank > 0), so nothing the
    # forward allocates implicitly lands on cuda:0.
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
