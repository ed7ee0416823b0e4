"""Log-probabilities of tokens under the model (what `logprobs`, `top_logprobs` and `echo` return).

They are the model's own distribution, log_softmax of the logits in fp32, before temperature, top-k or top-p
(as vLLM and SGLang return them by default): an evaluation harness scores a text by them, and they must not
depend on how the request samples. Pure functions: logits in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # alternatives per position at most (OpenAI's own bound for top_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability, and the `top` most likely tokens (id, logprob),
    most likely first (ties in token-id order)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_at(logits_TV: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """Row t of `logits_TV` scored at token_ids[t], with its `top` alternatives (0 <= top <= MAX_TOP_LOGPROBS)."""
    if not token_ids:
        return []
    logp_TV = torch.log_softmax(logits_TV[:len(token_ids)].float().cpu(), dim=-1)
    ids_T = torch.tensor(token_ids, dtype=torch.long)
    chosen_T = logp_TV.gather(1, ids_T[:, None])[:, 0].tolist()
    if top == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(token_ids, chosen_T)]
    # a stable sort, so equal log-probabilities come in token-id order on every machine
    best = torch.sort(logp_TV, dim=-1, descending=True, stable=True)
    values_TK, ids_TK = best.values[:, :top].tolist(), best.indices[:, :top].tolist()
    return [TokenLogprob(t, lp, tuple(zip(ids, values)))
            for t, lp, ids, values in zip(token_ids, chosen_T, ids_TK, values_TK)]
