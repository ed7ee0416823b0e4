"""The text of a sequence's output, decoded as it grows: a few token ids per step, not the whole output each time.

Decoding the whole output every step costs O(length) per token (7.6 ms a step at 4,000 tokens with Qwen's
tokenizer), and the stop-string search over the whole text too. Here, as text-generation-inference's decoder does,
each step decodes only a window: the ids from `prefix` (the previous step's start) to the end, less the text of
ids[prefix:read] (what was already counted), so a token whose text depends on its neighbours (a leading space, a
UTF-8 character split over several byte tokens) is still decoded in context. While the window's text ends in an
incomplete character (U+FFFD) nothing is added and the window waits for the next token; at the end of the output
(`final`), or when the window grows beyond MAX_PENDING ids (a model emitting invalid bytes), it is added as it is.
`find_stop` searches only where a new match can end: the new text and the longest stop string's length before it.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_PENDING = 8  # ids an incomplete character may hold back (a UTF-8 character is at most 4 bytes)
REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, detokenize: Callable[[list[int]], str]):
        self.detokenize = detokenize
        self.text = ""
        self._prefix = 0  # ids[prefix:read] decode to the end of `text`
        self._read = 0

    def update(self, ids: list[int], final: bool = False) -> str:
        """Catch up with `ids` (the output so far: the same list, grown); returns the text this added."""
        if len(ids) <= self._read:
            return ""
        counted = self.detokenize(ids[self._prefix:self._read]) if self._read > self._prefix else ""
        window = self.detokenize(ids[self._prefix:])
        if window.endswith(REPLACEMENT) and not final and len(ids) - self._read < MAX_PENDING:
            return ""  # an incomplete character: wait for its next byte
        added = window[len(counted):]
        self.text += added
        self._prefix, self._read = self._read, len(ids)
        return added


def find_stop(text: str, new: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in `text` whose match ends in its last `new` characters (earlier ones were
    searched before): (its start, the string), or None."""
    if not stops or new <= 0:
        return None
    start = max(0, len(text) - new - max(len(s) for s in stops) + 1)
    found = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
    return min(found) if found else None
