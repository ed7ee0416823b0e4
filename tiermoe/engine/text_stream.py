"""Turning a growing list of output token ids into text deltas that are safe to send.

Two things are held back until they are certain: a trailing incomplete UTF-8 character (decoded as U+FFFD),
and a tail that could still become a stop string (the answer must end before the stop string, and streamed
text cannot be taken back).
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, detokenize: Callable[[list[int]], str], stop: tuple[str, ...] = ()):
        self.detokenize = detokenize
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def delta(self, output_ids: list[int], finished: bool, stop_text_end: int | None = None) -> str:
        text = self.detokenize(output_ids)
        if finished:
            end = stop_text_end if stop_text_end is not None else len(text)
        else:
            end = len(text) - self.holdback
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out
