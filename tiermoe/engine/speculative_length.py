"""How many drafted tokens a sequence verifies this step: k in 0..K, chosen so the step's tokens per second rise.

A verify step feeding k + 1 rows of one sequence reads attention, dense and shared weights and the LM head once for
all of them, but the routed experts of every row: the union of their experts. A step's cost, relative to a
one-token step (`StepCost`):
    C(tokens) = (1 - e) + e x U(m) / U(1) + t x (tokens - 1)
- e: the routed experts' share of a one-token step (bytes read: K active experts per MoE layer against the rest);
- U(m) = E (1 - (1 - K/E)^m): the experts of m tokens routed independently, per layer;
- m: the step's independent-looking tokens: sum over its sequences of (rows)^reuse. Consecutive tokens of one
  sequence share experts (lag reuse): on the Qwen3-30B-A3B decode trace the experts of 2 / 3 / 4 consecutive tokens
  number 1.62x / 2.14x / 2.64x one token's, which is n^0.7 within 1% (independent routing: 3.73x at 4), hence
  reuse = 0.7; tokens of different sequences are taken as independent;
- t: each further row's own compute (attention over its context, norms, the LM head row), small where decode is
  bound by the bytes it reads.
Expected tokens from drafting k: 1 + f (1 + n + ... + n^(k-1)), f the chance the first drafted token is taken and n
that one is taken after the one before it was (the accepted run plus the token the verify step samples after it).
Sequences are taken in turn: each takes the k that maximises the step's expected tokens over its cost given the
choices before it (its extra tokens discounted by MARGIN), so k = 0 wherever drafting does not pay, and drafts in a
step already wide with other sequences' experts cost less (their union is mostly read anyway).

The acceptance estimate (`AcceptanceEstimate`) is per sequence: those two chances' taken and offered counts,
decayed by each step so it follows the text (a copy ends, a new one starts) and drifts back to its prior when it
stops drafting. The prior is the drafter's own record over every sequence (`Drafter.overall`, decayed slowly back to
PRIOR_ACCEPTANCE): a new sequence starts from what the drafter has been achieving, not from a fixed guess. With a
drafter that is never right, a fixed prior of 0.5 made every new reply draft some ten tokens in vain (0.94x plain
decode at acceptance 0 on the 8-layer Qwen3-30B-A3B shape); with one that is mostly right, replies draft from
their first step.
"""

from __future__ import annotations

from dataclasses import dataclass

# Prior acceptance of n-gram drafts before a sequence has verified any (weight: PRIOR_WEIGHT drafted tokens): an
# n-gram hit in copy-heavy text is accepted about that often (vLLM's and llama.cpp's prompt-lookup reports).
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
DECAY = 0.8  # per step: the last ~5 steps count (a copy ends abruptly: 10 rejections bring 0.9+ below 0.4)
# The drafter's record over all sequences, per step: the last ~100 steps' drafts count, and while nobody drafts it
# drifts back to PRIOR_ACCEPTANCE, so a drafter judged useless is tried again now and then: a drafter never right
# drafts one token about every 40 steps (at 0.97 it was every 11: on 32-token replies that is a draft a reply).
OVERALL_DECAY = 0.99
# A draft's expected extra tokens are counted at 1 / (1 + MARGIN): the costs and the acceptance are estimates (a fit
# of noisy step times, or bytes; a decayed rate), and a draft that only breaks even on paper loses when they are a
# little off. On the tokens, not on the step: each sequence's draft is judged alike whatever else the step holds.
MARGIN = 0.2
REUSE = 0.7  # lag reuse of experts between consecutive tokens of one sequence (see the module's docstring)


@dataclass
class AcceptanceEstimate:
    """One sequence's running acceptance of drafted tokens, as two chances: that the first drafted token is taken
    (`first`), and that a drafted token is taken after the one before it was (`next`). n-gram drafts are bursty:
    while the reply copies a passage nearly every draft is taken, elsewhere almost none; one per-token rate (their
    mix) would make long drafts look far worse than they are (at a 50/50 mix, 4 drafted tokens yield 3 tokens a
    step, where one rate of 0.5 says 1.94)."""

    first_taken: float = 0.0
    first_offered: float = 0.0
    next_taken: float = 0.0
    next_offered: float = 0.0
    decay: float = DECAY  # per step
    prior: tuple[float, float] = (PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE)  # (first, next) before any evidence

    def update(self, drafted: int, accepted: int) -> None:
        """A verify step's outcome: `accepted` of `drafted` tokens taken (the run up to the first rejection)."""
        self.idle()
        self.add(drafted, accepted)

    def add(self, drafted: int, accepted: int) -> None:
        """An outcome counted without ageing the rest (several sequences' outcomes in one step)."""
        self.first_offered += 1
        self.first_taken += accepted > 0
        if accepted > 0:  # positions 2..: each taken one a success, the rejection (if any) a failure
            self.next_taken += accepted - 1
            self.next_offered += accepted - 1 + (accepted < drafted)

    def idle(self) -> None:
        """A step without a draft: the evidence ages, so the estimate drifts back to the prior."""
        self.first_taken *= self.decay
        self.first_offered *= self.decay
        self.next_taken *= self.decay
        self.next_offered *= self.decay

    @property
    def first(self) -> float:
        return (self.first_taken + self.prior[0] * PRIOR_WEIGHT) / (self.first_offered + PRIOR_WEIGHT)

    @property
    def next(self) -> float:
        return (self.next_taken + self.prior[1] * PRIOR_WEIGHT) / (self.next_offered + PRIOR_WEIGHT)

    @property
    def rates(self) -> tuple[float, float]:
        return self.first, self.next


def expected_tokens(rate: float | tuple[float, float], k: int) -> float:
    """Tokens a verify step of k drafted tokens yields on average: the accepted run plus one. `rate`: the chance
    that each drafted token is taken, or (first, next) as AcceptanceEstimate gives them."""
    first, later = rate if isinstance(rate, tuple) else (rate, rate)
    return 1 + first * sum(later ** i for i in range(k))


@dataclass(frozen=True)
class StepShape:
    """What a step feeds, as its cost depends on it: `sequences` decoding (one row each), `verifying` of them with a
    draft, `drafted` rows in all, `independent` tokens as routing sees them (see StepCost), `other` prompt-chunk
    rows."""

    sequences: int = 0
    verifying: int = 0
    drafted: int = 0
    independent: float = 0.0
    other: int = 0

    @classmethod
    def of(cls, lengths: list[int], other: int = 0, reuse: float = REUSE) -> StepShape:
        """The step where the decoding sequences draft `lengths` tokens each."""
        return cls(len(lengths), sum(1 for k in lengths if k), sum(lengths),
                   other + sum((k + 1) ** reuse for k in lengths), other)

    def with_draft(self, k: int, reuse: float = REUSE) -> StepShape:
        """This step with one more decoding sequence, drafting k tokens."""
        return StepShape(self.sequences + 1, self.verifying + (k > 0), self.drafted + k,
                         self.independent + (k + 1) ** reuse, self.other)

    @property
    def rows(self) -> int:
        return self.sequences + self.drafted + self.other


@dataclass(frozen=True)
class StepCost:
    """A step's cost relative to a one-token decode step, from the bytes it reads (see the module's docstring)."""

    num_experts: int  # E: routed experts per MoE layer
    top_k: int  # K: experts per token
    expert_share: float  # e: the routed experts' share of a one-token step
    row_share: float = 0.02  # t: what one more row adds beyond its experts
    reuse: float = REUSE

    def __post_init__(self):
        if not (0 < self.top_k <= self.num_experts and 0 <= self.expert_share <= 1 and self.row_share >= 0
                and 0 < self.reuse <= 1):
            raise ValueError(f"bad StepCost {self}")

    def union(self, independent_tokens: float) -> float:
        """U(m): experts per layer that m independently routed tokens read."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** independent_tokens)

    def relative(self, tokens: int, independent_tokens: float) -> float:
        """C: the cost of a step of `tokens` rows over a one-token step's."""
        experts = self.union(independent_tokens) / self.union(1)
        return 1 - self.expert_share + self.expert_share * experts + self.row_share * (tokens - 1)

    def seconds(self, shape: StepShape) -> float:
        """The step's cost, in one-token steps."""
        return self.relative(shape.rows, shape.independent)

    def seconds_of(self, sequences: int, verifying: int, drafted: int, independent: float, other: int) -> float:
        """`seconds` of the step StepShape(sequences, verifying, drafted, independent, other) (no shape built)."""
        return self.relative(sequences + drafted + other, independent)


def choose_draft_lengths(cost, rates: list, longest: list[int], other_tokens: int = 0,
                         reuse: float | None = None) -> list[int]:
    """k per sequence (in the order given) of the step's decoding sequences: `rates` their acceptance estimates
    (a per-token chance, or (first, next) as AcceptanceEstimate.rates gives them),
    `longest` the most each may draft (what the drafter found, capped); `other_tokens`: rows of the step that are
    not these sequences' (prefill chunks). `cost`: a StepCost, or anything with `seconds_of` and `reuse`
    (tiermoe.engine.speculative_timing's measured one); `reuse`: the lag reuse to count with (default the cost's;
    the drafter passes what its verify steps measured, tiermoe.engine.speculative_reuse). Sequences not chosen yet
    count as plain decode rows. Runs every step: plain numbers, no shapes built per candidate."""
    n = len(rates)
    reuse = cost.reuse if reuse is None else reuse
    verifying = drafted = 0
    independent = float(other_tokens + n)  # every sequence plain: one independent token each
    produced = float(n)  # tokens the step yields without drafts
    chosen = []
    for rate, most in zip(rates, longest, strict=True):
        first, later = rate if isinstance(rate, tuple) else (rate, rate)
        best_k = 0
        if most > 0:
            best = produced / cost.seconds_of(n, verifying, drafted, independent, other_tokens)
            gain, run = 0.0, first
            for k in range(1, most + 1):
                gain += run  # expected_tokens(rate, k) - 1
                run *= later
                value = (produced + gain / (1 + MARGIN)) / cost.seconds_of(
                    n, verifying + 1, drafted + k, independent - 1 + (k + 1) ** reuse, other_tokens)
                if value > best:
                    best_k, best = k, value
        chosen.append(best_k)
        if best_k:
            verifying += 1
            drafted += best_k
            independent += (best_k + 1) ** reuse - 1
            produced += expected_tokens(rate, best_k) - 1
    return chosen
