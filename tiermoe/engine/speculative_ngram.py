"""N-gram (prompt lookup) drafting: the tokens that followed the latest earlier occurrence of the sequence's last n
tokens, n from the longest to the shortest (vLLM's and llama.cpp's prompt lookup). Pure: ids in, ids out.

Copy-heavy replies (rewriting, summarising, code edits, quoting) repeat spans of the prompt or of themselves; there
the continuation of the last match is the likely next text, and it costs no model. The latest match is preferred:
a reply that is copying a passage has its most recent occurrence in the passage being copied.

The search is bytes.rfind over the ids packed as 4-byte integers (a C loop: a 32k-token context takes tens of
microseconds), keeping only hits on a token boundary.
"""

from __future__ import annotations

from array import array


def ngram_draft(ids: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to `k` tokens proposed to follow `ids`: for n = max_n down to min_n, the tokens after the latest earlier
    occurrence of ids[-n:] (one that ends before the last token, so at least one token follows it); [] when no
    suffix of min_n or more tokens occurred before, or k < 1."""
    if k < 1 or len(ids) < min_n + 1:
        return []
    packed = array("i", ids)  # C ints: token ids are vocabulary rows, far below 2**31
    width = packed.itemsize
    raw = packed.tobytes()
    haystack = raw[:-width]  # a match must end before the last token: something follows it
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        needle = raw[-n * width:]
        end = len(haystack)
        while True:
            at = haystack.rfind(needle, 0, end)
            if at < 0:
                break
            if at % width == 0:
                start = at // width + n
                return list(ids[start:start + k])
            end = at + len(needle) - 1  # an unaligned hit: look again before it
    return []
