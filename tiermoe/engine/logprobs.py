"""Log-probabilities of tokens under the model (what `logprobs`, `top_logprobs` and `echo` return).

They are the model's own distribution, log_softmax of the logits in fp32, before temperature, top-k or top-p
(as vLLM and SGLang return them by default): an evaluation harness scores a text by them, and they must not
depend on how the request samples. Pure functions: logits in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # alternatives per position at most (OpenAI's own bound for top_logprobs)
ROWS_AT_ONCE = 64  # rows scored together: a transient of 64 x vocab fp32 (39 MB for a 152k vocabulary)


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability, and the `top` most likely tokens (id, logprob),
    most likely first (ties in token-id order)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_at(logits_TV: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """Row t of `logits_TV` scored at token_ids[t], with its `top` alternatives (0 <= top <= MAX_TOP_LOGPROBS).

    Rows are taken ROWS_AT_ONCE at a time, so an 8k-token `echo` prompt never holds [T, vocab] fp32 at once (a
    512-row chunk of a 152k vocabulary would be 311 MB), and the alternatives come from a top-k, not a sort of
    the vocabulary (9 s per 512-row chunk of Qwen's vocabulary, measured)."""
    out: list[TokenLogprob] = []
    for start in range(0, len(token_ids), ROWS_AT_ONCE):
        ids = token_ids[start:start + ROWS_AT_ONCE]
        logp_TV = torch.log_softmax(logits_TV[start:start + len(ids)].float().cpu(), dim=-1)
        chosen_T = logp_TV.gather(1, torch.tensor(ids, dtype=torch.long)[:, None])[:, 0].tolist()
        if top == 0:
            out += [TokenLogprob(t, lp) for t, lp in zip(ids, chosen_T)]
        else:
            out += [TokenLogprob(t, lp, best) for t, lp, best in zip(ids, chosen_T, _top_alternatives(logp_TV, top))]
    return out


def _top_alternatives(logp_TV: torch.Tensor, top: int) -> list[tuple[tuple[int, float], ...]]:
    """Each row's `top` most likely tokens, most likely first, equal log-probabilities in token-id order (on
    every machine): the row's values at least its top-k's last are few, and sorted stably among themselves."""
    kth_T1 = torch.topk(logp_TV, top, dim=-1).values[:, -1:]
    rows = []
    for row, kth in zip(logp_TV, kth_T1):
        candidates = torch.nonzero(row >= kth)[:, 0]  # ascending token ids; ties beyond top included
        order = torch.sort(row[candidates], descending=True, stable=True).indices[:top]
        rows.append(tuple(zip(candidates[order].tolist(), row[candidates[order]].tolist())))
    return rows
