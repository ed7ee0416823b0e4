"""One engine step as a ragged batch: every scheduled sequence's new tokens in ONE [1, T] forward over the KV pool.

The step's rows are ordered: decode rows first (one token after a past each, longest past first), then each
longer segment (a prompt chunk, or a preempted sequence's recompute). Attention runs in parts (`row_parts`): the
decode rows in runs of similar past lengths (each run one padded batch: padding stays within half the real keys,
or PAD_ALLOWANCE positions), then each segment alone. For every page group (full attention; each sliding window
size) the step holds, per part, the pages it reads, and for the whole step:
- write_index [T]: the pool slot of each new token's K/V (slot = page * page_size + offset);
- read_pages [N]: the pages attention reads, part after part (a decode run's rows each padded to the run's
  widest with page 0, the pool's never-written zero page); whole pages are gathered (one index_select of
  page-sized rows per layer, as transformers' own paged cache gathers token rows), and every position a query
  must not see (before the window, after the sequence's last token, a pad) is masked.
So a step writes only its new tokens and reads the past where it lies. Masks are additive (0 / dtype min),
[b, 1, q, w] per part, built once per step and group.

Given a `decode_attention` (tiermoe.layers.decode_attention: on the CPU, where every attention layer is served by
tiermoe.layers.paged_attention), the decode rows attend the pool in place instead: they get no gathered pages,
padding or masks, but per group each row's page table and first visible position (`DecodeIndex`), and the
gathered parts are the segments only (`first_gathered` indexes them in row_parts). Where that attention also
reads prompt chunks in place (`reads_chunks`: the Triton kernel, CUDA's, and the CPU's native kernel but for MLA),
nothing is gathered: each chunk gets its page table (`GroupIndex.chunk_tables`); the Triton kernel takes its rows
in blocks of CHUNK_ROWS (`chunk_blocks`), the native kernel row by row (`chunk_rows`).

The engine's steps write their tensors into the pool's step buffers (tiermoe.layers.step_buffers: the same
addresses every step), all but the gathered parts' masks: a mask holds a value per key read, so a buffer for them
would be as large as a full step's keys, and the path a CUDA graph would capture, decode rows attending in place
through their page tables, needs none (on a GPU that takes a paged decode kernel, which tiermoe has not yet: there
the decode rows are gathered, masks included). A step built without buffers (a test's) gets fresh tensors.

A key position k is visible to a query at position p when k <= p and, in a sliding group of window w,
k > p - w (transformers' sliding_window_overlay).
Legend: T new tokens, N read pages, P page size, b rows of a part, q its queries per row, w its keys per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermoe.layers.host_copies import to_device_async
from tiermoe.layers.step_buffers import CHUNK_ROWS, StepBuffers

# Key positions a decode run may pad beyond half its real keys: a run that small is cheaper padded than split.
PAD_ALLOWANCE = 256


@dataclass(frozen=True)
class SeqFeed:
    """One sequence in a step: `past` tokens already in the pool, `new` fed now, its page table per group."""

    past: int
    new: int
    pages: dict[int | None, list[int]]  # window (None: full attention) -> page ids covering positions 0.. (-1: freed)
    slot: int | None = None  # its linear-attention state slot (models with linear-attention layers)
    # a speculative verify segment: its linear-attention states after each position are kept, so the next step may
    # continue from the last kept one (tiermoe.layers.linear_attention_slots)
    verify: bool = False


@dataclass(frozen=True)
class RowPart:
    """Rows of the step that one attention call takes: a run of decode rows (b of them, q = 1 query each), or
    one segment (b = 1, q queries); `first_feed` is the index of its first sequence in the step's feeds."""

    first_feed: int
    b: int
    q: int
    rows: slice


@dataclass(frozen=True)
class PartKeys:
    """One part's keys in a page group: its pages [first, end) of read_pages, and its mask [b, 1, q, w]."""

    first: int
    end: int
    mask: torch.Tensor


@dataclass(frozen=True)
class DecodeIndex:
    """The decode rows of one page group when they attend in place."""

    tables: torch.Tensor  # [n, W] int64: each row's page ids from position 0 to its last page (0 where freed)
    lo: torch.Tensor  # [n] int32: each row's first visible key position
    keys: int  # visible keys of all rows together


@dataclass(frozen=True)
class GroupIndex:
    """One page group's step indices (see the module docstring)."""

    write_index: torch.Tensor  # [T] int64 slots
    read_pages: torch.Tensor  # [N] int64 page ids of the gathered parts
    parts: tuple[PartKeys, ...]  # in step.row_parts[step.first_gathered:] order
    decode: DecodeIndex | None = None  # when the decode rows attend in place
    chunk_tables: torch.Tensor | None = None  # [chunks, W] int64 when the prompt chunks attend in place


def decode_runs(pasts: list[int], allowance: int = PAD_ALLOWANCE) -> list[tuple[int, int]]:
    """Split decode rows (past lengths, longest first) into consecutive runs [start, end) whose padding (to the
    run's longest) stays within max(half the real keys, allowance)."""
    runs, start = [], 0
    for i in range(1, len(pasts) + 1):
        if i < len(pasts):
            real = sum(p + 1 for p in pasts[start:i + 1])
            if (i + 1 - start) * (max(pasts[start:i + 1]) + 1) - real <= max(real // 2, allowance):
                continue
        runs.append((start, i))
        start = i
    return runs


class RaggedStep:
    """The layout of one step's forward: rows, positions and, per page group, its GroupIndex."""

    def __init__(self, feeds: list[SeqFeed], page_size: int, layer_windows: dict[int, int | None | str],
                 device: torch.device, mask_dtype: torch.dtype, num_decode: int | None = None,
                 decode_attention=None, buffers: StepBuffers | None = None,
                 state_indices: tuple[list[int], list[int]] | None = None):
        """`num_decode`: how many leading feeds are decode rows (one token after a past; default: all the leading
        one-token feeds). `decode_attention`: how the decode rows attend in place (None: gathered, like segments).
        `buffers`: where the step's tensors are written (None: fresh ones). `state_indices`: per feed, the
        linear-attention state it reads and the one it writes (tiermoe.layers.linear_attention_slots), if any."""
        if buffers is not None:
            buffers.check(len(feeds), sum(f.new for f in feeds))
            self._stage = buffers.stage
        else:
            self._stage = lambda name, host: host.to(device)
        self.feeds = feeds
        self.layer_windows = layer_windows  # decoder layer -> its page group's window (or LINEAR: no pages)
        self.page_size = page_size
        if num_decode is None:
            num_decode = next((i for i, f in enumerate(feeds) if f.new != 1), len(feeds))
        self.num_decode = num_decode
        if any(f.new != 1 for f in feeds[:num_decode]) or any(f.new < 1 for f in feeds):
            raise ValueError("a ragged step lists its decode rows (one token each) first, then its segments")
        self.row_parts = [RowPart(a, b - a, 1, slice(a, b)) for a, b in decode_runs(
            [f.past for f in feeds[:num_decode]])]
        self.decode_attention = decode_attention if num_decode > 0 else None
        # the prompt chunks attend in place too where the attention reads them (the Triton kernel, CUDA's; the
        # native kernel up to its max_chunk_rows, the CPU's)
        max_rows = getattr(decode_attention, "max_chunk_rows", None)
        reads_chunks = (getattr(decode_attention, "reads_chunks", False) and num_decode < len(feeds)
                        and (max_rows is None or max(f.new for f in feeds[num_decode:]) <= max_rows))
        self.chunk_attention = decode_attention if reads_chunks else None
        self.first_gathered = len(self.row_parts) if self.decode_attention is not None else 0
        self.decode_pos = None  # [num_decode] int32 query positions, when the decode rows attend in place
        if self.decode_attention is not None:
            self.decode_pos = self._stage("decode_pos", torch.tensor([f.past for f in feeds[:num_decode]],
                                                                     dtype=torch.int32))
        row = num_decode
        for i, f in enumerate(feeds[num_decode:], start=num_decode):
            self.row_parts.append(RowPart(i, 1, f.new, slice(row, row + f.new)))
            row += f.new
        self.chunk_blocks = None  # [B, 4] int32 (first row, rows, chunk, first query position) per block
        if self.chunk_attention is not None:
            self.first_gathered = len(self.row_parts)
            blocks, row = [], num_decode
            for j, f in enumerate(feeds[num_decode:]):
                blocks += [[row + b, min(CHUNK_ROWS, f.new - b), j, f.past + b] for b in range(0, f.new, CHUNK_ROWS)]
                row += f.new
            self.chunk_blocks = self._stage("chunk_blocks", torch.tensor(blocks, dtype=torch.int32))
        self.position_ids = self._stage("position_ids", torch.tensor([[f.past + i for f in feeds
                                                                       for i in range(f.new)]]))
        self.state_read = self.state_write = None  # [F] int64, per feed
        if state_indices is not None:
            self.state_read = self._stage("state_read", torch.tensor(state_indices[0]))
            self.state_write = self._stage("state_write", torch.tensor(state_indices[1]))
        self.groups = {w: self._group(w, device, mask_dtype) for w in dict.fromkeys(layer_windows.values())
                       if not isinstance(w, str)}
        self._in_place: dict[int | None, tuple[DecodeIndex, torch.Tensor]] = {}  # rows_in_place, per group
        self._chunk_rows: dict[int | None, tuple[DecodeIndex, torch.Tensor]] = {}  # chunk_rows, per group

    def _group(self, window: int | None, device: torch.device, mask_dtype: torch.dtype) -> GroupIndex:
        size, low = self.page_size, torch.finfo(mask_dtype).min
        # host arithmetic on the page lists: per decode row one slot, where torch would dispatch a few ops a row
        write = [f.pages[window][p // size] * size + p % size
                 for f in self.feeds for p in range(f.past, f.past + f.new)]
        read, parts = [], []
        for part in self.row_parts[self.first_gathered:]:
            rows = range(part.first_feed, part.first_feed + part.b)
            spans = [(_first_visible(self.feeds[i].past, window) // size,
                      (self.feeds[i].past + self.feeds[i].new - 1) // size + 1) for i in rows]
            width = max(end - first for first, end in spans)  # pages per row
            first_read = sum(len(r) for r in read)
            k_pos, q_pos = [], []
            for i, (first, end) in zip(rows, spans):
                pages = torch.tensor(self.feeds[i].pages[window][first:end], dtype=torch.long)
                if bool((pages < 0).any()):
                    raise ValueError(f"a query of this step sees a page the pool has already freed (window {window})")
                read.append(torch.cat([pages, torch.zeros(width - len(pages), dtype=torch.long)]))
                positions = torch.arange(first * size, (first + width) * size)
                positions[(end - first) * size:] = -1  # pads: never visible
                k_pos.append(positions)
                f = self.feeds[i]
                q_pos.append(torch.arange(f.past, f.past + f.new))
            k_bw, q_bq = torch.stack(k_pos), torch.stack(q_pos)
            visible = (k_bw[:, None, :] >= 0) & (k_bw[:, None, :] <= q_bq[:, :, None])  # [b, q, w]
            if window is not None:
                visible &= k_bw[:, None, :] > q_bq[:, :, None] - window
            # per step, not in the buffers (see the module docstring); uploaded without the host waiting
            mask = to_device_async(torch.zeros(visible.shape, dtype=mask_dtype).masked_fill_(~visible, low)[:, None],
                                   device)
            parts.append(PartKeys(first_read, first_read + part.b * width, mask))
        write_index = self._stage(("write_index", window), torch.tensor(write, dtype=torch.long))
        read_pages = self._stage(("read_pages", window), torch.cat(read) if read else torch.zeros(0, dtype=torch.long))
        decode = self._decode_index(window) if self.decode_attention is not None else None
        chunks = self._chunk_tables(window) if self.chunk_attention is not None else None
        return GroupIndex(write_index, read_pages, tuple(parts), decode, chunks)

    def rows_in_place(self, window: int | None) -> tuple[DecodeIndex, torch.Tensor]:
        """Every row of the step (decode rows and prompt rows alike) as one query attending its sequence's pages in
        place: (DecodeIndex of all T rows, pos [T] int32), for a whole-layer call (tiermoe.layers.fused_decode_layer)
        on a step with prompt rows. A row sees its sequence's keys up to its own position, whose K/V the same call
        writes first, so a prompt is causal row by row. Built on first use per group (host lists, fresh tensors:
        never on a path a CUDA graph captures), then kept."""
        if window not in self._in_place:
            tables, pos, lo, keys = [], [], [], 0
            for f in self.feeds:
                for p in range(f.past, f.past + f.new):
                    first = _first_visible(p, window)
                    tables.append(self._table_row(f.pages[window], first, p, window))
                    pos.append(p)
                    lo.append(first)
                    keys += p + 1 - first
            width = max(len(t) for t in tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            self._in_place[window] = (DecodeIndex(table, torch.tensor(lo, dtype=torch.int32), keys),
                                      torch.tensor(pos, dtype=torch.int32))
        return self._in_place[window]

    @property
    def decode_only(self) -> bool:
        """Whether every row is a decode row attending the pool in place (its index built)."""
        return self.decode_attention is not None and self.num_decode == len(self.feeds)

    def chunk_rows(self, window: int | None) -> tuple[DecodeIndex, torch.Tensor]:
        """The prompt chunks' rows (the step's rows after its decode rows), each a query attending its sequence's
        pages in place: (DecodeIndex of those rows, pos [rows] int32). Each row takes its chunk's table (pages up
        to the chunk's last query; a row reads only its keys [lo, pos]). Built on first use per group, then kept."""
        if window not in self._chunk_rows:
            segments = self.feeds[self.num_decode:]
            pos = [f.past + i for f in segments for i in range(f.new)]
            lo = [_first_visible(p, window) for p in pos]
            chunk_tables = self.groups[window].chunk_tables
            tables = chunk_tables.repeat_interleave(torch.tensor([f.new for f in segments],
                                                                 device=chunk_tables.device), dim=0)
            index = DecodeIndex(tables, torch.tensor(lo, dtype=torch.int32, device=tables.device),
                                sum(p + 1 - first for p, first in zip(pos, lo)))
            self._chunk_rows[window] = (index, torch.tensor(pos, dtype=torch.int32, device=tables.device))
        return self._chunk_rows[window]

    def attend_in_place(self, window: int | None, q_THd: torch.Tensor, k_SHd: torch.Tensor, v_SHd: torch.Tensor,
                        scale: float, sinks_H: torch.Tensor | None, out_THd: torch.Tensor) -> None:
        """Every row that attends the pool in place: the decode rows, and the prompt chunks' rows where the
        attention reads them (`chunk_attention`)."""
        if self.chunk_attention is None:  # decode rows only: no slice to dispatch (a decode step counts its ops)
            self.attend_decode_rows(window, q_THd, k_SHd, v_SHd, scale, sinks_H, out_THd)
            return
        if self.decode_attention is not None:
            self.attend_decode_rows(window, q_THd[:self.num_decode], k_SHd, v_SHd, scale, sinks_H,
                                    out_THd[:self.num_decode])
        self.chunk_attention.attend_chunks(self, window, q_THd, k_SHd, v_SHd, scale, sinks_H, out_THd)

    def attend_decode_rows(self, window: int | None, q_THd: torch.Tensor, k_SHd: torch.Tensor, v_SHd: torch.Tensor,
                           scale: float, sinks_H: torch.Tensor | None, out_THd: torch.Tensor,
                           kr_SHd: torch.Tensor | None = None) -> None:
        """The step's decode rows (its first num_decode rows) attending the pool in place in the page group of
        `window`, through `decode_attention.attend` (the native kernel's or the Triton kernel's: one signature)."""
        decode = self.groups[window].decode
        self.decode_attention.attend(q_THd, k_SHd, v_SHd, decode.tables, self.decode_pos, decode.lo, self.page_size,
                                     scale, decode.keys, sinks_H, out_THd, kr_SHd)

    def state_rows(self, part: RowPart) -> tuple[torch.Tensor, torch.Tensor]:
        """The linear-attention states the feeds of `part` read and write ([b] int64 each)."""
        if self.state_read is None:
            raise ValueError("this step was built without linear-attention state indices")
        feeds = slice(part.first_feed, part.first_feed + part.b)
        return self.state_read[feeds], self.state_write[feeds]

    def _table_row(self, pages: list[int], lo: int, pos: int, window: int | None) -> list[int]:
        """A query's page table: the page ids covering key positions 0..pos, zeros for pages before its first
        visible position `lo` (never read). ValueError when a page it sees has been freed."""
        first = lo // self.page_size
        visible = pages[first:pos // self.page_size + 1]
        if min(visible) < 0:
            raise ValueError(f"a query of this step sees a page the pool has already freed (window {window})")
        return [0] * first + visible

    def _chunk_tables(self, window: int | None) -> torch.Tensor:
        """Each prompt chunk's page table [chunks, W]: its page ids from position 0 to its last query's page,
        zeros before its first query's first visible key (never read)."""
        rows = [self._table_row(f.pages[window], _first_visible(f.past, window), f.past + f.new - 1, window)
                for f in self.feeds[self.num_decode:]]
        width = max(len(r) for r in rows)
        return self._stage(("chunk_tables", window),
                           torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long))

    def _decode_index(self, window: int | None) -> DecodeIndex:
        size, rows = self.page_size, range(self.num_decode)
        lo = [_first_visible(self.feeds[i].past, window) for i in rows]
        ends = [self.feeds[i].past // size + 1 for i in rows]  # pages up to each row's query
        width, out = max(ends), []
        for i in rows:  # host lists: the table's bytes are copied once, into the step buffer
            out.append(self._table_row(self.feeds[i].pages[window], lo[i], self.feeds[i].past, window)
                       + [0] * (width - ends[i]))
        keys = sum(self.feeds[i].past + 1 - lo[i] for i in rows)
        return DecodeIndex(self._stage(("tables", window), torch.tensor(out, dtype=torch.long)),
                           self._stage(("lo", window), torch.tensor(lo, dtype=torch.int32)), keys)


def _first_visible(past: int, window: int | None) -> int:
    """The first key position any of a sequence's queries this step sees (its first query is at `past`)."""
    return 0 if window is None else max(0, past - window + 1)
