"""One engine step as a ragged batch: every scheduled sequence's new tokens in ONE [1, T] forward over the KV pool.

The step's rows are ordered: decode rows first (one token each, in the order given), then each longer segment
(a prompt chunk, or a preempted sequence's recompute). For every page group (full attention; each sliding window
size) the step knows, as index tensors into that group's pool slots (slot = page * page_size + offset):
- write_index [T]: where each new token's K/V goes;
- read_index [K]: what attention reads, in row order: the decode rows padded to the longest decode row's
  visible length (pads read slot 0, the pool's never-written zero slot, and are masked), then each segment's
  visible keys, contiguous.
So a step writes only its new tokens and reads the past where it lies: the one gather per layer (index_select,
as transformers' own paged cache does) is the K/V attention reads, nothing beyond it. Masks are additive
(0 / dtype min) per decode batch [B, 1, 1, Lmax] and per segment [1, 1, n, k], built once per step and group.

A key position q is visible to a query at position p when q <= p and, in a sliding group of window w,
q > p - w (transformers' sliding_window_overlay).
Legend: T new tokens, K read keys, B decode rows, Lmax longest decode row's visible keys, n/k a segment's
queries/keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL = None  # the window of full-attention layers


@dataclass(frozen=True)
class SeqFeed:
    """One sequence in a step: `past` tokens already in the pool, `new` fed now, its page table per group."""

    past: int
    new: int
    pages: dict[int | None, list[int]]  # window (FULL = None) -> page ids covering positions 0.. (-1: freed)
    slot: int | None = None  # its linear-attention state slot (models with linear-attention layers)


@dataclass(frozen=True)
class RowPart:
    """Rows of the step that one attention call takes: the decode rows together (b of them, q = 1 query each),
    or one segment (b = 1, q queries); `first_feed` is the index of its first sequence in the step's feeds."""

    first_feed: int
    b: int
    q: int
    rows: slice


@dataclass(frozen=True)
class GroupIndex:
    """One page group's step indices (see the module docstring)."""

    write_index: torch.Tensor  # [T] int64
    read_index: torch.Tensor  # [K] int64
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax] additive, None without decode rows
    decode_width: int  # Lmax
    segment_keys: tuple[tuple[int, int], ...]  # per segment, its [start, end) in read_index
    segment_masks: tuple[torch.Tensor, ...]  # per segment [1, 1, n, k] additive


class RaggedStep:
    """The layout of one step's forward: rows, positions and, per page group, its GroupIndex."""

    def __init__(self, feeds: list[SeqFeed], page_size: int, layer_windows: dict[int, int | None | str],
                 device: torch.device, mask_dtype: torch.dtype, num_decode: int | None = None):
        """`num_decode`: how many leading feeds (one token each) attend as one padded batch; default: all the
        leading one-token feeds."""
        self.feeds = feeds
        self.layer_windows = layer_windows  # decoder layer -> its page group's window (or LINEAR: no pages)
        self.page_size = page_size
        if num_decode is None:
            num_decode = next((i for i, f in enumerate(feeds) if f.new != 1), len(feeds))
        self.num_decode = num_decode
        if any(f.new != 1 for f in feeds[:num_decode]) or any(f.new < 1 for f in feeds):
            raise ValueError("a ragged step lists its decode rows (one token each) first, then its segments")
        self.segments = [(self.num_decode + sum(f.new for f in feeds[self.num_decode:i]), f.new)
                         for i, f in enumerate(feeds) if i >= self.num_decode]  # (first row, rows)
        self.row_parts = ([RowPart(0, self.num_decode, 1, slice(0, self.num_decode))] if self.num_decode else []) + [
            RowPart(self.num_decode + j, 1, n, slice(r0, r0 + n)) for j, (r0, n) in enumerate(self.segments)]
        self.num_tokens = sum(f.new for f in feeds)
        self.position_ids = torch.tensor([[f.past + i for f in feeds for i in range(f.new)]], device=device)
        self.groups = {w: self._group(w, device, mask_dtype) for w in dict.fromkeys(layer_windows.values())
                       if not isinstance(w, str)}

    def _group(self, window: int | None, device: torch.device, mask_dtype: torch.dtype) -> GroupIndex:
        low = torch.finfo(mask_dtype).min
        tables = [torch.tensor(f.pages[window], dtype=torch.long) for f in self.feeds]
        write = [self._slots(t, f.past, f.past + f.new) for t, f in zip(tables, self.feeds)]
        first_seen = [_first_visible(f.past, window) for f in self.feeds]
        decode = self.feeds[:self.num_decode]
        seen_B = torch.tensor([f.past + 1 - first_seen[b] for b, f in enumerate(decode)], dtype=torch.long)
        width = int(seen_B.max()) if decode else 0
        read, decode_mask = [], None
        if decode:
            for b, f in enumerate(decode):
                read += [self._slots(tables[b], first_seen[b], f.past + 1),
                         torch.zeros(width - int(seen_B[b]), dtype=torch.long)]  # pads: the zero slot
            real_BL = torch.arange(width)[None, :] < seen_B[:, None]
            decode_mask = _additive(real_BL, mask_dtype, low)[:, None, None].to(device)
        keys, masks, at = [], [], sum(len(r) for r in read)
        for i, f in enumerate(self.feeds[self.num_decode:], start=self.num_decode):
            start, end = first_seen[i], f.past + f.new
            keys.append((at, at + end - start))
            at += end - start
            read.append(self._slots(tables[i], start, end))
            q_pos, k_pos = torch.arange(f.past, end)[:, None], torch.arange(start, end)[None, :]
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            masks.append(_additive(visible, mask_dtype, low)[None, None].to(device))
        return GroupIndex(torch.cat(write).to(device), torch.cat(read).to(device) if read else
                          torch.zeros(0, dtype=torch.long, device=device), decode_mask, width, tuple(keys),
                          tuple(masks))

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Pool slots of positions [start, end) of a sequence whose page table is `table`."""
        positions = torch.arange(start, end)
        pages = table[positions // self.page_size]
        if bool((pages < 0).any()):
            raise ValueError(f"positions {start}-{end - 1} reach a page the pool has already freed")
        return pages * self.page_size + positions % self.page_size


def _additive(visible: torch.Tensor, dtype: torch.dtype, low: float) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, low)


def _first_visible(past: int, window: int | None) -> int:
    """The first key position any of a sequence's queries this step sees (its first query is at `past`)."""
    return 0 if window is None else max(0, past - window + 1)
