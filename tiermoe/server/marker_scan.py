"""Finding a reply's markers (`</think>`, `<tool_call>`, harmony's `<|message|>`...) in text that arrives a piece at
a time, each character scanned a bounded number of times.

A scanner holds back a tail that could be the start of a marker (shorter than the longest one) and scans it again
with the next piece: so a stream step scans its new text and a few characters more, whatever the reply's length
(re-parsing the whole reply each step cost O(length) per token).
"""

from __future__ import annotations


def find_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest of `markers` in `text`: (where it starts, which one), or None."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else None


def held_length(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that could be the start of one of `markers`."""
    for cut in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-cut:]
        if any(m.startswith(tail) for m in markers):
            return cut
    return 0


class MarkerScanner:
    """Pieces of text in, the text before the first of `markers` out."""

    def __init__(self, markers: tuple[str, ...]):
        self.markers, self.tail = markers, ""

    def feed(self, piece: str, final: bool) -> tuple[str, str | None, str]:
        """(the text known to come before any marker, the marker found or None, the text after it). Without a
        marker, a tail that could start one is kept for the next piece, unless this is the last (`final`)."""
        window, self.tail = self.tail + piece, ""
        hit = find_marker(window, self.markers)
        if hit is not None:
            at, marker = hit
            return window[:at], marker, window[at + len(marker):]
        keep = 0 if final else held_length(window, self.markers)
        self.tail = window[len(window) - keep:]
        return window[:len(window) - keep], None, ""
