"""Turning a growing list of output token ids into text deltas that are safe to send.

Two things are held back until they are certain: a trailing incomplete UTF-8 character (the sequence's
IncrementalText adds none), and a tail that could still become a stop string (the answer must end before the stop
string, and streamed text cannot be taken back). The text comes from the sequence's own IncrementalText
(Engine.decoded_text: the one its stop strings are searched in), so a step decodes a few ids, not the output.
"""

from __future__ import annotations

from tiermoe.engine.incremental_text import REPLACEMENT, IncrementalText


class TextStream:
    def __init__(self, decoded: IncrementalText, stop: tuple[str, ...] = ()):
        self.decoded = decoded
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def delta(self, output_ids: list[int], finished: bool, stop_text_end: int | None = None) -> str:
        self.decoded.update(output_ids, final=finished)
        text = self.decoded.text
        if finished:
            end = stop_text_end if stop_text_end is not None else len(text)
        else:
            end = len(text) - self.holdback
            while end > self.sent and text[end - 1] == REPLACEMENT:
                end -= 1
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out
