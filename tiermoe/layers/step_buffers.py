"""A step's metadata in tensors reserved once: every step writes its page tables and indices into the same memory.

A ragged step (tiermoe.layers.ragged_step) hands its forward small integer tensors: the token ids, their positions,
the rows whose logits are kept, the pool slots the new K/V go to, per page group the pages the gathered parts
read, and for decode rows that attend the pool in place each row's page table, query position and first visible
key, for prompt chunks that do each chunk's page table and its rows' blocks (plus, with linear-attention layers,
each row's state slots). Made fresh every step they would lie at a new
address each time, and a CUDA graph replays the addresses it captured. So the KV pool reserves one `StepBuffers`
on its device, sized for the largest step its engine schedules, and each step writes into prefixes of it: a
buffer's first n entries, viewed in the step's shape, start at the buffer's own address whatever n is.

Each buffer takes ONE copy per step, from a tensor the step built on the host: on a CUDA device through a
page-locked mirror, uploaded asynchronously (a mirror is rewritten only once its last upload has completed), on
the CPU straight into the buffer. A step larger than the buffers is refused with a TiermoeError: the engine's
scheduler never builds one (max_running rows, max_running + prefill_chunk tokens); `Engine.feed` can be asked to.
Bytes: per page group 2 x rows x pages x 8 (the decode page tables and the gathered pages), a few KB besides;
e.g. 32 rows of 128k-token contexts in 16-token pages: 4 MiB a group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tiermoe.errors import TiermoeError

Name = str | tuple[str, int | None]  # a step-wide buffer, or (kind, window) of a page group's
# Query rows of one prompt chunk that one program of an in-place attention kernel takes (a chunk's rows are cut into
# blocks of at most this many: tiermoe.layers.triton_paged_attention).
CHUNK_ROWS = 16


@dataclass(frozen=True)
class StepLimits:
    """The largest step the buffers take."""

    tokens: int  # new tokens in one step (the engine's max_running + prefill_chunk)
    rows: int  # sequences in one step (max_running)
    pages: int  # pages of one sequence's table (its longest context, in pages)


class StepBuffers:
    def __init__(self, limits: StepLimits, windows: Iterable[int | None], device: torch.device):
        """Buffers for a step over the page groups of `windows` (None: full attention) on `device`."""
        self.limits = limits
        self.device = torch.device(device)
        T, R, P = limits.tokens, limits.rows, limits.pages
        long, int32 = torch.long, torch.int32
        sizes: dict[Name, tuple[int, torch.dtype, str]] = {
            "input_ids": (T, long, "tokens"), "position_ids": (T, long, "tokens"),
            "logits_to_keep": (T, long, "tokens"), "decode_pos": (R, int32, "rows"),
            "state_read": (R, long, "rows"), "state_write": (R, long, "rows"),
            "chunk_blocks": ((T // CHUNK_ROWS + R) * 4, int32, "tokens")}
        for w in windows:
            sizes |= {("write_index", w): (T, long, "tokens"), ("read_pages", w): (R * P, long, "pages"),
                      ("tables", w): (R * P, long, "pages"), ("lo", w): (R, int32, "rows"),
                      ("chunk_tables", w): (R * P, long, "pages")}
        self._limit = {name: limit for name, (_, _, limit) in sizes.items()}
        # empty: a step reads only the entries it wrote (on the host, pages never written stay unmapped); inference
        # tensors: written in place whether or not the caller is in inference mode
        with torch.inference_mode():
            self._buffers = {name: torch.empty(n, dtype=dtype, device=self.device)
                             for name, (n, dtype, _) in sizes.items()}
            pinned = self.device.type == "cuda"
            self._mirrors = {name: torch.empty(n, dtype=dtype, pin_memory=True)
                             for name, (n, dtype, _) in sizes.items()} if pinned else None
        self._uploaded: dict[Name, torch.cuda.Event] = {}  # a mirror's last upload (CUDA)

    def check(self, rows: int, tokens: int) -> None:
        """Refuse a step of `rows` sequences feeding `tokens` in all that the buffers cannot take."""
        if rows > self.limits.rows:
            raise TiermoeError(f"a step of {rows} sequences: the step buffers hold {self.limits.rows} (max_running)")
        if tokens > self.limits.tokens:
            raise TiermoeError(f"a step of {tokens} tokens: the step buffers hold {self.limits.tokens} "
                               f"(max_running + prefill_chunk)")

    def stage(self, name: Name, host: torch.Tensor) -> torch.Tensor:
        """`host` (a CPU tensor of the buffer's dtype) written into buffer `name`'s first entries in ONE copy;
        returns them on the device, in host's shape."""
        buffer = self._buffers[name]
        n = host.numel()
        if n > buffer.numel():
            limit = {"tokens": "max_running + prefill_chunk tokens", "rows": "max_running sequences",
                     "pages": f"max_running sequences x {self.limits.pages} pages"}[self._limit[name]]
            raise TiermoeError(f"this step's {_label(name)} needs {n} entries: the step buffers hold "
                               f"{buffer.numel()} ({limit})")
        with torch.inference_mode():
            out = buffer[:n].view(host.shape)
            if self._mirrors is None:  # the CPU device: host memory both (written as the CUDA upload is, no wait)
                return out.copy_(host, non_blocking=True)
            done = self._uploaded.get(name)
            if done is not None:
                done.synchronize()
            mirror = self._mirrors[name][:n].view(host.shape).copy_(host)
            out.copy_(mirror, non_blocking=True)
            done = self._uploaded[name] = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        return out

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in one of the buffers."""
        return any(t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in self._buffers.values())

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


def _label(name: Name) -> str:
    return name if isinstance(name, str) else f"{name[0]} (window {name[1]})"
