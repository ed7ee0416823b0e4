"""Log-probabilities (tiermoe.engine.logprobs) in the shapes the APIs return them.

- Chat completions (and Ollama, which copied it): `{"content": [{token, logprob, bytes, top_logprobs}]}`, one entry
  per generated token; `top_logprobs` holds the N most likely alternatives.
- Completions (the legacy shape evaluation harnesses read): parallel lists `tokens`, `token_logprobs`,
  `top_logprobs` (a {token: logprob} map per position with the N most likely and the chosen token, so up to N + 1
  entries) and `text_offset` (where each token starts in the returned text). With echo the prompt's tokens come
  first; the very first has no logprob (null), having nothing before it.

A token's text is the tokenizer's decoding of that one id ("token_id:N" for a model served without a tokenizer);
`bytes` are its UTF-8 bytes. A character split over several byte-level tokens decodes to U+FFFD in each piece, as
in vLLM: the text of the whole answer is exact, the pieces' bytes are not.
"""

from __future__ import annotations

from collections.abc import Callable

from tiermoe.engine.logprobs import TokenLogprob

TokenText = Callable[[int], str]


def token_text_of(tokenizer) -> TokenText:
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id])


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(text_of: TokenText, scored: list[TokenLogprob]) -> list[dict]:
    """The `content` list of a chat completion's (or an Ollama response's) logprobs."""
    return [{**_entry(text_of(s.token_id), s.logprob),
             "top_logprobs": [_entry(text_of(i), lp) for i, lp in s.top]} for s in scored]


def completion_logprobs(text_of: TokenText, token_ids: list[int], scored: list[TokenLogprob | None],
                        text_offset: int = 0) -> dict:
    """The `logprobs` object of a completion for `token_ids` (scored[i] None: a position with no logprob, the
    echoed prompt's first token); offsets count from `text_offset`, where this piece starts in the text."""
    pieces = [text_of(t) for t in token_ids]
    offsets = []
    for piece in pieces:
        offsets.append(text_offset)
        text_offset += len(piece)
    tops = [None if s is None else {**{text_of(i): lp for i, lp in s.top}, piece: s.logprob}
            for piece, s in zip(pieces, scored)]
    return {"tokens": pieces, "token_logprobs": [None if s is None else s.logprob for s in scored],
            "top_logprobs": tops, "text_offset": offsets}
