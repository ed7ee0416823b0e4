"""Lag reuse measured live: how many experts a verify step's consecutive tokens of one sequence read together.

The draft-length cost model (tiermoe.engine.speculative_length) counts a sequence's n = k + 1 verified rows as
n^reuse independently routed tokens: per MoE layer they read the union of their experts, about K n^reuse of them
(reuse 1: as if routed independently; 0: every row the same experts). REUSE (0.7) was fitted to one model's decode
trace; each model and each text has its own. The engine's verify steps measure it: a segment of n >= 2 consecutive
rows of one sequence routes, at each MoE layer, to D distinct experts, and log(mean D / K) / log(n) over the layers
is one sample of reuse. The estimate is the samples' mean, decayed per verify step so it follows the text, starting
from the prior (REUSE) with the weight of PRIOR_WEIGHT samples.

LagReuse is a recorder (tiermoe.stats.recording) armed only for the passes that verify drafts (the drafter arms it
when it schedules one, the pass's end disarms it), so a plain step pays nothing; a verify pass's routed ids reach
the host once, at its end, all layers together.
"""

from __future__ import annotations

import math

import torch

from tiermoe.engine.speculative_length import REUSE
from tiermoe.stats.recording import PassInfo

PRIOR_WEIGHT = 4.0  # samples the prior counts as
DECAY = 0.95  # per verify pass: the last ~20 verify steps count
LOWEST = 0.05  # a segment whose rows all read the same experts: near 0, kept positive (the cost model needs > 0)


class LagReuse:
    def __init__(self, top_k: int, prior: float = REUSE):
        self.top_k, self.prior = top_k, prior
        self.armed = False  # the next pass verifies drafts: record it
        self.samples = 0  # segments measured (metrics, tests)
        self._total = self._weight = 0.0
        self._segments: list[tuple[int, int]] = []  # this pass's (first row, rows) of each verify segment
        self._ids: list[torch.Tensor] = []  # this pass's routed ids [T, K], one per MoE layer

    @property
    def enabled(self) -> bool:
        return self.armed

    @property
    def reuse(self) -> float:
        return (self._total + self.prior * PRIOR_WEIGHT) / (self._weight + PRIOR_WEIGHT)

    def begin_pass(self, info: PassInfo) -> None:
        self._ids, self._segments, row = [], [], 0
        for n, prefill in zip(info.num_tokens, info.is_prefill, strict=True):
            if n >= 2 and not prefill:
                self._segments.append((row, n))
            row += n

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        if self._segments:
            self._ids.append(ids_TK)

    def end_pass(self) -> None:
        self.armed = False
        if self._segments and self._ids:
            self.observe(torch.stack([ids.to(torch.int64) for ids in self._ids]).cpu(), self._segments)
        self._ids, self._segments = [], []

    def observe(self, ids_LTK: torch.Tensor, segments: list[tuple[int, int]]) -> None:
        """One verify pass: its routed experts [MoE layers, rows, K] and its segments (first row, rows)."""
        self._total *= DECAY
        self._weight *= DECAY
        layers = ids_LTK.shape[0]
        for start, n in segments:
            experts = ids_LTK[:, start:start + n].reshape(layers, -1).sort(dim=1).values
            distinct = 1 + (experts[:, 1:] != experts[:, :-1]).sum(dim=1)
            ratio = max(1.0, distinct.double().mean().item() / self.top_k)
            self._total += min(1.0, max(LOWEST, math.log(ratio) / math.log(n)))
            self._weight += 1.0
            self.samples += 1
