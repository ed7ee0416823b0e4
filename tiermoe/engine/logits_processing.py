"""What changes a sequence's logits before the sampler sees them, as vLLM applies it: min_tokens (EOS and stop ids
masked until enough tokens are out), logit_bias, then the penalties (repetition over the prompt and the output,
frequency and presence over the output).

Only sequences that ask for one of them come here (SamplingParams.adjusts_logits): the unconstrained path samples
the model's logits untouched. The penalties touch only the tokens they concern: a sequence's LogitsAdjuster keeps
the ids seen so far (prompt and output, for the repetition penalty) and the output's counts, grown by the tokens
added since its last step, so a step costs a copy of the logits and work in the number of distinct tokens seen, not
the vocabulary or the output's length. A preempted sequence keeps its adjuster, since its output is not sampled
again. Torch on the host, where the engine hands the sampler its logits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tiermoe.engine.sampling import SamplingParams


class LogitsAdjuster:
    """One sequence's logits processing: `adjust(logits_V, output_ids)` returns new logits (the given ones are left
    as they are: log-probabilities are computed from them)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], eos_token_ids: Iterable[int]):
        self.params = params
        # min_tokens holds back what would end the sequence: EOS (unless ignored) and the stop ids
        self.stop_ids = sorted({*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)})
        self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        self.bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        self.seen = TokenSet(prompt_ids if params.repetition_penalty != 1.0 else ())  # prompt and output (repetition)
        self.output = TokenSet(())  # the output's distinct tokens (frequency, presence)
        self.counts_V: torch.Tensor | None = None  # the output's tokens by id, made at the first step
        self.counted = 0  # output tokens already counted

    def adjust(self, logits_V: torch.Tensor, output_ids: list[int]) -> torch.Tensor:
        params, vocab = self.params, logits_V.shape[-1]
        logits_V = logits_V.detach().to("cpu", torch.float32, copy=True)
        if len(output_ids) < params.min_tokens:
            logits_V[[t for t in self.stop_ids if t < vocab]] = float("-inf")
        if params.logit_bias:
            inside = self.bias_ids < vocab  # ids were checked against the embedding; the LM head may be shorter
            logits_V.index_add_(0, self.bias_ids[inside], self.bias_values[inside])
        self._count(output_ids, vocab)
        if params.repetition_penalty != 1.0:
            ids = self.seen.below(vocab)
            values = logits_V[ids]
            logits_V[ids] = torch.where(values > 0, values / params.repetition_penalty,
                                        values * params.repetition_penalty)
        if params.frequency_penalty or params.presence_penalty:
            ids = self.output.below(vocab)  # all of them: output tokens were sampled from logits this wide
            penalty = params.frequency_penalty * self.counts_V[ids] + params.presence_penalty
            logits_V.index_add_(0, ids, -penalty)
        return logits_V

    def _count(self, output_ids: list[int], vocab: int) -> None:
        if self.counts_V is None:
            self.counts_V = torch.zeros(vocab, dtype=torch.float32)
        for token in output_ids[self.counted:]:
            self.counts_V[token] += 1
            self.output.add(token)
            if self.params.repetition_penalty != 1.0:
                self.seen.add(token)
        self.counted = len(output_ids)


class TokenSet:
    """Distinct token ids in the order first seen, with their tensor (extended as ids come, not rebuilt)."""

    def __init__(self, ids: Iterable[int]):
        self.ids = list(dict.fromkeys(ids))
        self._known = set(self.ids)
        self._tensor = torch.tensor(self.ids, dtype=torch.long)
        self._pending: list[int] = []

    def add(self, token: int) -> None:
        if token not in self._known:
            self._known.add(token)
            self.ids.append(token)
            self._pending.append(token)

    def below(self, vocab: int) -> torch.Tensor:
        """The ids below `vocab` (the logits' width: a prompt id may be an embedding row the LM head lacks)."""
        if self._pending:
            self._tensor = torch.cat([self._tensor, torch.tensor(self._pending, dtype=torch.long)])
            self._pending = []
        return self._tensor[self._tensor < vocab]
