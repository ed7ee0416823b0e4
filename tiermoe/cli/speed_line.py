"""The one-line speed summary printed after a reply (`generate`, `chat --verbose`), as llama.cpp and
`ollama run --verbose` print theirs: how long the prompt took to give its first token, and the decode rate.

Pure: the caller measures, this only words the figures, so every front end prints the same line.
"""

from __future__ import annotations


def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def speed_line(prompt_tokens: int, ttft_s: float, decode_tokens: int, decode_s: float) -> str:
    """E.g. "prompt 12 tokens, first token 0.21 s, decode 31 tokens at 45.2 tok/s".

    prompt_tokens: ids of the prompt as the model saw it (chat template included). ttft_s: seconds from the
    request to its first generated token (the prefill, and the first sampling). decode_tokens: tokens generated
    after the first, in decode_s seconds; without any (or without measurable time), no rate is given.
    """
    if min(prompt_tokens, decode_tokens) < 0 or min(ttft_s, decode_s) < 0:
        raise ValueError(f"speed figures must be >= 0, got {prompt_tokens=}, {ttft_s=}, {decode_tokens=}, "
                         f"{decode_s=}")
    decode = f"decode {_tokens(decode_tokens)}"
    if decode_tokens and decode_s > 0:
        decode += f" at {decode_tokens / decode_s:.1f} tok/s"
    return f"prompt {_tokens(prompt_tokens)}, first token {ttft_s:.2f} s, {decode}"
