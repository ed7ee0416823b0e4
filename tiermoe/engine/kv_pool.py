"""The engine's KV pool: one per device, reserved once, shared by all sequences through page tables.

The memory is tiermoe.layers.kv_pages (K/V pages per attention layer) and, for models with linear attention,
tiermoe.layers.linear_attention_slots (per-sequence state slots). This file is the bookkeeping: which pages and
slot each sequence holds. Page groups follow the model's layer kinds (tiermoe.layers.paged_attention.layer_windows):
- full attention (window None): a sequence holds pages for every token it has fed;
- a sliding window w: only the pages that hold one of its last w - 1 positions (older ones are handed back after
  each step, `trim`), plus, during a step, its new tokens: `sliding_pages` bounds the group by the windows of all
  running sequences and one step's tokens;
- linear attention: no pages; one state slot per running sequence.

Page 0 is never handed out (see KVPages). Rank 0 hands pages out; a step's tables travel with the step
(tiermoe.distributed), so every rank's pool holds the same tokens in the same slots (a follower's pool zeroes a
page, as rank 0's does when it hands one out, before a step first writes there).

The pool also reserves the step buffers (tiermoe.layers.step_buffers) its steps (`step`) write their page tables
and indices into: sized for max_sequences rows, max_sequences + max_chunk tokens and the pages of the longest
context, the largest step the engine schedules.

With prefix reuse on (tiermoe.engine.prefix_index; models whose layers are all full attention: a sliding window's
or a linear-attention layer's state at a page boundary is not kept) a sequence that ends hands its full pages to
the index, and `match` gives a new sequence the pages its prompt starts with.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from tiermoe.config import DEFAULT_PAGE_SIZE
from tiermoe.engine.prefix_index import PrefixIndex, page_keys
from tiermoe.layers.kv_pages import KVPages
from tiermoe.layers.linear_attention_slots import LinearStateSlots
from tiermoe.layers.paged_attention import LINEAR
from tiermoe.layers.ragged_step import RaggedStep, SeqFeed
from tiermoe.layers.step_buffers import StepBuffers, StepLimits


@dataclass
class SeqPages:
    """One sequence's share of the pool: page ids per group covering positions 0.. (-1: handed back), its slot."""

    tables: dict[int | None, list[int]]
    slot: int | None = None


def sliding_pages(window: int, page_size: int, max_sequences: int, prefill_chunk: int) -> int:
    """Pages a sliding group can need at once: each running sequence's last window - 1 positions (straddling a
    page boundary), its new tokens of a step (one decode token, or a share of the step's prefill budget) and
    their partial pages."""
    return max_sequences * (math.ceil((window - 1) / page_size) + 3) + math.ceil(prefill_chunk / page_size)


class KVPool:
    def __init__(self, layer_windows: dict[int, int | None | str], tokens: int, max_sequences: int,
                 device: torch.device, page_size: int = DEFAULT_PAGE_SIZE, max_chunk: int = 512,
                 prefix_cache: bool = False, max_context: int | None = None):
        """`tokens`: full-attention tokens the pool holds in all; `max_sequences`: sequences running at once;
        `max_chunk`: prompt tokens a step feeds in all (sizes the sliding groups); `max_context`: the most tokens
        one sequence reaches (None: the pool's). The last three size the step buffers too."""
        if tokens < 1 or max_sequences < 1:
            raise ValueError(f"a KV pool needs tokens and sequences >= 1, got {tokens} and {max_sequences}")
        self.layer_windows = layer_windows
        self.page_size = page_size
        self.capacity = math.ceil(tokens / page_size)  # full-attention pages
        windows = {w for w in layer_windows.values() if w != LINEAR}
        counts = {w: self.capacity if w is None else min(
            self.capacity, sliding_pages(w, page_size, max_sequences, max_chunk)) for w in windows}
        self.pages = KVPages(counts or {None: 1}, page_size, device)
        self._free = {w: deque(range(1, n + 1)) for w, n in counts.items()}
        has_linear = LINEAR in layer_windows.values()
        self.linear = LinearStateSlots(max_sequences, device) if has_linear else None
        self._free_slots = deque(range(max_sequences)) if has_linear else deque()
        self.prefix = PrefixIndex() if prefix_cache and self.reuse_possible else None
        longest = min(self.tokens, max_context or self.tokens)
        limits = StepLimits(max_sequences + max_chunk, max_sequences, math.ceil(longest / page_size))
        self.step_buffers = StepBuffers(limits, windows, device)

    def step(self, feeds: list[SeqFeed], mask_dtype: torch.dtype, num_decode: int | None = None,
             decode_attention=None) -> RaggedStep:
        """The ragged step of `feeds` over this pool (see RaggedStep), written into the pool's step buffers."""
        for f in feeds:  # a follower's pool hands no page out (rank 0 does): it zeroes a page at its first write
            for window, table in f.pages.items():
                for page in table[f.past // self.page_size:(f.past + f.new - 1) // self.page_size + 1]:
                    self.pages.prepare(window, page)
        states = None
        if self.linear is not None:  # a sequence that kept part of its last verify segment continues from there
            self.linear.rewind(feeds)
            states = self.linear.indices([f.slot for f in feeds])
        return RaggedStep(feeds, self.page_size, self.layer_windows, self.pages.device, mask_dtype, num_decode,
                          decode_attention, self.step_buffers, states)

    @property
    def reuse_possible(self) -> bool:
        """Prefix reuse needs every layer's state at a page boundary: full attention only."""
        return set(self.layer_windows.values()) == {None}

    @property
    def tokens(self) -> int:
        """Tokens of full attention the pool can hold (one sequence's most, all sequences' together)."""
        return self.capacity * self.page_size

    def new_share(self) -> SeqPages:
        return SeqPages({w: [] for w in self._free})

    def free_pages(self, window: int | None = None) -> int:
        """Pages that can be handed out: free ones, and indexed ones no sequence holds (evicted when taken)."""
        if window not in self._free:
            return 0
        idle = len(self.prefix.idle) if self.prefix is not None and window is None else 0
        return len(self._free[window]) + idle

    def used_pages(self) -> dict[int | None, int]:
        """Pages running sequences hold, per group."""
        return {w: self.pages.num_pages[w] - self.free_pages(w) for w in self._free}

    def cached_pages(self) -> int:
        """Indexed pages no sequence holds (prefix reuse)."""
        return len(self.prefix.idle) if self.prefix is not None else 0

    def _take(self, window: int | None) -> int:
        free = self._free[window]
        page = free.popleft() if free else self.prefix.evict()
        self.pages.prepare(window, page)
        return page

    def match(self, share: SeqPages, token_ids: list[int], most: int, salt: bytes = b"") -> int:
        """Give a new sequence the indexed pages its `token_ids` start with, at most `most` tokens of them;
        returns the tokens matched (whole pages). `salt`: its adapter's (tiermoe.engine.prefix_index.page_keys)."""
        if self.prefix is None or share.tables[None]:
            return 0
        for key in page_keys(token_ids, self.page_size, most // self.page_size, salt):
            page = self.prefix.take(key)
            if page is None:
                break
            share.tables[None].append(page)
        return len(share.tables[None]) * self.page_size

    def reserve(self, share: SeqPages, fed: int, upto: int) -> bool:
        """Give `share` pages (and a slot) for positions up to `upto` (it has fed `fed`); all or nothing:
        False, with nothing taken, when the pool has too few free."""
        if self.linear is not None and share.slot is None and not self._free_slots:
            return False
        wanted = {w: math.ceil(upto / self.page_size) - len(table) for w, table in share.tables.items()}
        if any(n > self.free_pages(w) for w, n in wanted.items()):
            return False
        for w, n in wanted.items():
            share.tables[w] += [self._take(w) for _ in range(n)]
        if self.linear is not None and share.slot is None:
            share.slot = self._free_slots.popleft()
            self.linear.reset(share.slot)
        return True

    def trim(self, share: SeqPages, fed: int) -> None:
        """After a step: hand back the sliding groups' pages that no later query of this sequence sees."""
        for w, table in share.tables.items():
            if w is None:
                continue
            first_needed = max(0, fed - w + 1) // self.page_size  # the page of the next query's first visible key
            start = first_needed
            while start > 0 and table[start - 1] >= 0:  # the pages before a handed-back one are handed back too
                start -= 1
            self._free[w].extend(table[start:first_needed])
            table[start:first_needed] = [-1] * (first_needed - start)

    def shrink(self, share: SeqPages, upto: int) -> None:
        """Hand back the pages past those covering positions up to `upto` (rejected speculative drafts: their
        positions will be written again before any query reads them, so the pages need not be held meanwhile)."""
        keep = math.ceil(upto / self.page_size)
        for w, table in share.tables.items():
            self._free[w].extend(p for p in table[keep:] if p >= 0)
            del table[keep:]

    def release(self, share: SeqPages, token_ids: list[int] = (), salt: bytes = b"") -> None:
        """A sequence finished, failed or was preempted: every page and its slot go back; with prefix reuse, the
        full pages of `token_ids` (the tokens it fed) go to the index, under its adapter's `salt`."""
        for w, table in share.tables.items():
            if w is None and self.prefix is not None:
                keys = page_keys(token_ids, self.page_size, len(token_ids) // self.page_size, salt)
                table[:] = [p for i, p in enumerate(table) if not self.prefix.give_back(p, keys[i] if i < len(keys)
                                                                                           else None)]
            self._free[w].extend(p for p in table if p >= 0)
            table.clear()
        if share.slot is not None:
            self.linear.reset(share.slot)  # and the states its last verify segment kept go
            self._free_slots.append(share.slot)
            share.slot = None

    def feed(self, share: SeqPages, fed: int, new: int, verify: bool = False) -> SeqFeed:
        """The step's view of a sequence feeding `new` tokens after `fed` (pages reserved first); `verify`: they
        are its last token and drafts (its linear-attention states after each are kept for a rollback)."""
        return SeqFeed(fed, new, share.tables, share.slot, verify)

    def commit(self, feeds: list[SeqFeed]) -> None:
        """The step of these feeds succeeded: their linear-attention states are now the new ones."""
        if self.linear is not None:
            self.linear.commit([f.slot for f in feeds])

    def nbytes(self) -> int:
        return self.pages.nbytes() + (self.linear.nbytes() if self.linear is not None else 0)
