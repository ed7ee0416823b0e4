"""Prefix reuse: full pages of the KV pool found again by the token ids they hold.

A page's key is a digest of every token id from the sequence's start to the page's end (a chain: the previous
page's key and this page's ids), so two sequences share a page only when their whole prefixes agree (and their
LoRA adapters served per request: an adapter's salt starts its chain). A sequence
that ends (or is preempted) hands its full pages to the index instead of freeing them; a new sequence whose
prompt starts with indexed pages takes them (counted: several sequences may read one page; none writes it, since
a sequence writes only positions past its matched pages). Pages no sequence holds stay readable until the pool
needs them: the least recently used is evicted first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def page_keys(token_ids: list[int], page_size: int, pages: int, salt: bytes = b"") -> list[bytes]:
    """The keys of the first `pages` full pages of `token_ids`; `salt` starts the chain (a sequence's adapter:
    the same tokens computed with another adapter, or none, are other K/V)."""
    keys, previous = [], hashlib.sha256(salt).digest() if salt else b""
    for i in range(pages):
        chunk = np.asarray(token_ids[i * page_size:(i + 1) * page_size], dtype=np.int64).tobytes()
        previous = hashlib.sha256(previous + chunk).digest()
        keys.append(previous)
    return keys


class PrefixIndex:
    def __init__(self):
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.holders: dict[int, int] = {}  # indexed page -> sequences holding it
        self.idle: OrderedDict[int, None] = OrderedDict()  # indexed pages nobody holds, least recently used first

    def __len__(self) -> int:
        return len(self.key_of)

    def take(self, key: bytes) -> int | None:
        """The page indexed under `key`, now held once more; None when there is none."""
        page = self.page_of.get(key)
        if page is not None:
            self.holders[page] += 1
            self.idle.pop(page, None)
        return page

    def give_back(self, page: int, key: bytes | None) -> bool:
        """A sequence lets go of `page`, which holds the full page `key` (None: not a full page). True when the
        index keeps the page (it is indexed, or now is); False when the caller frees it."""
        if page in self.key_of:
            self.holders[page] -= 1
            if self.holders[page] == 0:
                self.idle[page] = None
            return True
        if key is None or key in self.page_of:  # partial, or the same tokens already indexed in another page
            return False
        self.page_of[key], self.key_of[page], self.holders[page] = page, key, 0
        self.idle[page] = None
        return True

    def evict(self) -> int | None:
        """Drop the least recently used idle page from the index and return it for reuse; None when none is idle."""
        if not self.idle:
            return None
        page, _ = self.idle.popitem(last=False)
        del self.page_of[self.key_of.pop(page)], self.holders[page]
        return page
