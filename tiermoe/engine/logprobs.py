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
    every machine). One top-k of `top` + 1 a row decides it for the rows where the (top + 1)-th value is below the
    top-th: their top tokens are exactly the top-k's, ordered here. A row whose cut falls inside a run of equal
    values (or holds a NaN) takes every token at least its top-th value and sorts those stably: that pass over the
    vocabulary, a row at a time, cost 0.5 ms a row of a 152k vocabulary when every row took it."""
    width = logp_TV.shape[-1]
    if top >= width:  # no token beyond the cut: every row takes the slow pass (a tiny vocabulary)
        return [_top_with_ties(row, top) for row in logp_TV]
    values_TK, ids_TK = torch.topk(logp_TV, top + 1, dim=-1)
    clean_T = (values_TK[:, top] < values_TK[:, top - 1]) & ~values_TK.isnan().any(dim=-1)
    ids_TK, by_id_TK = ids_TK[:, :top].sort(dim=-1)  # token-id order first, so the stable sort keeps it in ties
    values_TK = values_TK[:, :top].gather(1, by_id_TK)
    order_TK = torch.sort(values_TK, dim=-1, descending=True, stable=True).indices
    ids, values = ids_TK.gather(1, order_TK).tolist(), values_TK.gather(1, order_TK).tolist()
    return [tuple(zip(ids[t], values[t])) if clean else _top_with_ties(logp_TV[t], top)
            for t, clean in enumerate(clean_T.tolist())]


def _top_with_ties(logp_V: torch.Tensor, top: int) -> tuple[tuple[int, float], ...]:
    """One row's `top` most likely tokens when its top-k alone cannot tell: the values at least its top-k's last
    are few, and sorted stably among themselves."""
    kth = torch.topk(logp_V, min(top, logp_V.shape[-1])).values[-1]
    candidates = torch.nonzero(logp_V >= kth)[:, 0]  # ascending token ids; ties beyond top included
    order = torch.sort(logp_V[candidates], descending=True, stable=True).indices[:top]
    return tuple(zip(candidates[order].tolist(), logp_V[candidates[order]].tolist()))
