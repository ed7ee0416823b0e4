"""A drafter whose drafts are accepted at a chosen rate, for tests and benchmarks of speculative decoding.

It knows each prompt's greedy continuation (a plain run's tokens, given up front) and drafts, per position, the
true next token with probability `acceptance`, else a token that is certainly wrong (any other one). The verify
step does not know that: it runs the same forward, rejects the first wrong token and keeps the model's own token
there, so tokens/s and the rolled-back state are those of real drafts accepted at that rate. Greedy only: with
sampling the continuation is not known. A sequence whose output left the continuation (a tie decided the other
way) drafts nothing more.
"""

from __future__ import annotations

import random

from tiermoe.engine.sequence import Sequence
from tiermoe.engine.speculative_config import SpeculativeConfig
from tiermoe.engine.speculative_drafting import Drafter


class ForcedAcceptanceDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig, cost, max_context: int | None,
                 continuations: dict[tuple[int, ...], list[int]], acceptance: float, vocab_size: int, seed: int = 0):
        """`continuations`: prompt ids -> its greedy output ids; `acceptance`: the chance (0..1) that a drafted
        token is the true one; `vocab_size`: wrong tokens are drawn below it."""
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be from 0 to 1, got {acceptance}")
        if vocab_size < 2:
            raise ValueError(f"a wrong draft needs a vocabulary of 2 tokens or more, got {vocab_size}")
        super().__init__(config, cost, max_context)
        self.continuations = continuations
        self.forced_acceptance = acceptance
        self.vocab_size = vocab_size
        self.random = random.Random(seed)

    def propose(self, decoding: list[Sequence], rooms: list[int], budget: int) -> list[list[int]]:
        found = []
        for seq, room in zip(decoding, rooms, strict=True):
            found.append(self._draft(seq, min(room, budget)))
            budget -= len(found[-1])
        return found

    def _draft(self, seq: Sequence, most: int) -> list[int]:
        target = self.continuations.get(tuple(seq.prompt_ids))
        done = len(seq.output_ids)
        if most < 1 or target is None or seq.output_ids != target[:done]:
            return []
        draft = []
        for true in target[done:done + most]:
            wrong = (true + self.random.randrange(1, self.vocab_size)) % self.vocab_size
            draft.append(true if self.random.random() < self.forced_acceptance else wrong)
        return draft
