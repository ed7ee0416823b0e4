"""The engine's drafter: per step, the drafted tokens each decoding sequence verifies (speculative decoding).

A sequence drafts only where verification can keep its output exact: it is decoding (not prefilling), has no
grammar (its mask would need each drafted prefix's grammar state), and has room for more than one more token
(max_tokens, the model's context). Drafts share the step's token budget with prompt chunks: they take what the
prompt chunks leave of `prefill_chunk`, so a verify step never exceeds the step buffers the pool sized, nor
stalls a prefill. The drafts are n-gram lookups (tiermoe.engine.speculative_ngram); with `adaptive`, each draft is
cut to the length the step's cost model chooses (tiermoe.engine.speculative_length), 0 included.

The routed experts' share of a step, which that choice weighs, is counted in bytes: K active experts per MoE
layer at the model's width against every other weight a token reads (attention, dense and shared MLPs, norms, the
LM head). A CPU tier quantised to int4 makes experts cheaper than this says, and on small models the host's
per-step overhead dominates what bytes predict: the estimate then leans toward shorter drafts, never longer.
"""

from __future__ import annotations

from tiermoe.engine.sequence import Sequence
from tiermoe.engine.speculative_config import SpeculativeConfig
from tiermoe.engine.speculative_length import (
    OVERALL_DECAY,
    REUSE,
    AcceptanceEstimate,
    StepCost,
    StepShape,
    choose_draft_lengths,
)
from tiermoe.engine.speculative_ngram import ngram_draft
from tiermoe.engine.speculative_reuse import LagReuse
from tiermoe.engine.speculative_timing import MeasuredStepCost

# Adaptive lengths: after this many steps without a draft, one step decides with the bytes model instead of the
# measured cost. A fit that once found drafts too dear only sees plain steps after that, which teach it nothing about
# drafts; one sequence trying again now and then (a few percent of the steps) lets it find that the text or the load
# changed.
EXPLORE_AFTER = 32


class Drafter:
    def __init__(self, config: SpeculativeConfig, cost: StepCost | MeasuredStepCost, max_context: int | None):
        """`cost`: what adaptive lengths weigh; a MeasuredStepCost learns from the steps the engine times."""
        self.config = config
        self.cost = cost
        self.max_context = max_context
        self.dry_steps = 0  # steps in a row without any draft (adaptive: see EXPLORE_AFTER)
        self.overall = AcceptanceEstimate(decay=OVERALL_DECAY)  # every sequence's outcomes: each one's prior
        self.drafted_tokens = 0  # drafted tokens verified, over all sequences (metrics, benchmarks)
        self.accepted_tokens = 0  # of them, accepted
        # adaptive lengths: the lag reuse they count with, measured on the verify passes the engine records into it
        model = cost.model if isinstance(cost, MeasuredStepCost) else cost
        self.routing = LagReuse(model.top_k, model.reuse) if config.adaptive and model is not None else None

    @property
    def reuse(self) -> float:
        """Lag reuse of experts between consecutive tokens of a sequence, as this engine's verify steps measure it."""
        return REUSE if self.routing is None else self.routing.reuse

    def room(self, seq: Sequence) -> int:
        """The most tokens `seq` may draft now: K, within max_tokens (the verify step samples one more) and the
        model's context (the drafts' positions must exist)."""
        if seq.grammar is not None or seq.prefilling or seq.finished:
            return 0
        most = min(self.config.max_draft, seq.params.max_tokens - len(seq.output_ids) - 1)
        if self.max_context is not None:
            most = min(most, self.max_context - seq.num_tokens)
        return max(0, most)

    def drafts(self, decoding: list[Sequence], budget: int, other_tokens: int) -> dict[int, list[int]]:
        """seq_id -> the tokens it verifies this step (absent: none), for the step's decoding sequences in order;
        `budget`: drafted tokens the step can take in all; `other_tokens`: the step's prompt-chunk tokens."""
        rooms = [self.room(seq) for seq in decoding]
        self.overall.idle()
        rates = [self.acceptance(seq).rates for seq in decoding] if self.config.adaptive else []
        cost = self.cost
        if isinstance(cost, MeasuredStepCost) and self.dry_steps >= EXPLORE_AFTER:
            # a measured "never" is tried again now and then (the load and the text change), by one sequence
            cost = cost.model
            first = next((i for i, r in enumerate(rooms) if r), None)
            rooms = [r if i == first else 0 for i, r in enumerate(rooms)]
        reuse = self.reuse
        if self.config.adaptive:  # no lookup where even a full draft would not pay (a busy batch: none at all)
            rooms = self.lookup_limits(rooms, choose_draft_lengths(cost, rates, rooms, other_tokens, reuse))
        found = self.propose(decoding, rooms, budget)
        if self.config.adaptive and any(found):
            lengths = choose_draft_lengths(cost, rates, [len(d) for d in found], other_tokens, reuse)
            found = [draft[:k] for draft, k in zip(found, lengths, strict=True)]
        out = {}
        for seq, draft in zip(decoding, found, strict=True):
            if draft:
                out[seq.seq_id] = draft
            else:
                self.acceptance(seq).idle()
        self.dry_steps = 0 if out else self.dry_steps + 1
        if self.routing is not None:
            self.routing.armed = bool(out)  # the step verifies drafts: its routing measures the lag reuse
        return out

    def lookup_limits(self, rooms: list[int], chosen: list[int]) -> list[int]:
        """The most each sequence looks up, given the lengths the cost model chose for full rooms: the whole room
        where it chose any (a lookup costs nothing; what it finds is weighed again), else none."""
        return [r if k else 0 for r, k in zip(rooms, chosen, strict=True)]

    def propose(self, decoding: list[Sequence], rooms: list[int], budget: int) -> list[list[int]]:
        """Each sequence's draft of at most rooms[i] tokens, `budget` tokens in all (n-gram lookup)."""
        found = []
        for seq, room in zip(decoding, rooms, strict=True):
            most = min(room, budget)
            draft = ngram_draft(seq.known_ids, most, self.config.ngram_max, self.config.ngram_min) if most else []
            found.append(draft)
            budget -= len(draft)
        return found

    # What a drafter with a model of its own (tiermoe.engine.speculative_mtp) hooks into; n-gram lookup needs none.
    def pool_layers(self, windows: dict) -> dict:
        """The KV pool's layers (index -> window): the model's, and the drafter's own."""
        return windows

    def attach(self, pool) -> None:
        """The engine's KV pool, once made."""

    def forwarded(self, seqs: list[Sequence], inputs: list[list[int]]) -> None:
        """A forward of the target fed inputs[i] to seqs[i] (its row order; their fed counts not yet advanced)."""

    def stepped(self, batch: list[Sequence]) -> None:
        """The step's tokens are taken (its sequences' fed counts and outputs are final)."""

    def close(self) -> None:
        """The engine closes."""

    def step_shape(self, batch: list[Sequence], inputs: list[list[int]]) -> StepShape:
        """What a scheduled step feeds (before it runs: the sequences' drafts and prefill state as scheduled)."""
        lengths, other = [], 0
        for seq, fed in zip(batch, inputs, strict=True):
            if seq.draft or (len(fed) == 1 and not seq.prefilling):
                lengths.append(len(seq.draft))
            else:
                other += len(fed)
        return StepShape.of(lengths, other, self.reuse)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step's wall seconds: a measured cost learns from it."""
        if isinstance(self.cost, MeasuredStepCost):
            self.cost.observe(shape, seconds)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verify step's outcome for `seq`."""
        self.acceptance(seq).update(drafted, accepted)
        self.overall.add(drafted, accepted)
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted

    def acceptance(self, seq: Sequence) -> AcceptanceEstimate:
        """`seq`'s estimate, whose prior is the drafter's record over every sequence as it stands now."""
        if seq.acceptance is None:
            seq.acceptance = AcceptanceEstimate()
        seq.acceptance.prior = self.overall.rates
        return seq.acceptance


def step_cost_of(hybrid) -> StepCost:
    """The cost model of `hybrid`'s steps: its routing (E, K) and the routed experts' share of the bytes a token
    reads (its K experts per MoE layer at the model's width, against the non-expert weights as loaded: parameters
    and packed buffers, the input embedding left out unless it is also the LM head)."""
    spec, model = hybrid.spec, hybrid.model
    active = spec.top_k * spec.bytes_per_expert(model.dtype) * spec.num_moe_layers
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # the routed experts live in the tiers
    other = sum(t.numel() * t.element_size() for t in tensors.values())
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    table = getattr(embeddings, "weight", None)
    if table is not None and table is not getattr(head, "weight", None):  # tied: the LM head reads it whole
        other -= table.numel() * table.element_size()  # a token reads one row of it, not the table
    return StepCost(spec.num_experts, spec.top_k, active / max(1, active + max(0, other)))
