"""Safetensors checkpoints read by hand: headers only for inspection, and tensor bytes straight into their tier.

We parse the safetensors header ourselves (8-byte little-endian length, then JSON) and read tensor bytes with
`readinto` into the destination tensor's own memory. Unlike `safe_open` (which memory-maps the files), this
leaves no file-backed pages mapped into the process, so resident memory stays what the tiers hold, and a GPU-tier
expert passes through one small host buffer only. Slices along the first dimension (one expert of a fused
`[E, ...]` tensor) are contiguous on disk and are read without touching the other experts.

FP8 block-quantised tensors (a `name_scale_inv` beside `name`) read into a non-FP8 destination are dequantised
on the way (codes and scales of that one tensor or slice pass through a temporary), so every caller that asks for
bf16/fp32 gets the true values; callers that keep FP8 read the codes and the scales themselves.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tiermoe.checkpoint.fp8 import scale_name
from tiermoe.errors import TiermoeError
from tiermoe.experts.fp8_blocks import DEFAULT_BLOCK, FP8_DTYPES, dequantize_fp8

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: `offset` is absolute in `file`."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Tensor entries of one safetensors file, from its header alone, every entry checked against the file: a
    known dtype, a shape of non-negative integers, `data_offsets` inside the data section whose length is the
    shape's bytes, and no two tensors sharing bytes. A bad entry is refused (one line naming the file and the
    tensor): trusted, it would load silently wrong weights."""
    try:
        with open(file, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than 8 bytes")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER_BYTES, file_size - 8):
                raise ValueError(f"header length {length} is larger than the file ({file_size} bytes) allows")
            header = json.loads(f.read(length), object_pairs_hook=_refuse_duplicates)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as err:
        raise TiermoeError(f"{file} is not a valid safetensors file ({err})") from None
    if not isinstance(header, dict):
        raise TiermoeError(f"{file} is not a valid safetensors file (its header is not a JSON object)")
    data_size = file_size - 8 - length
    entries = {name: _entry(file, name, info, 8 + length, data_size)
               for name, info in header.items() if name != "__metadata__"}
    _check_no_overlap(file, entries)
    return entries


def _refuse_duplicates(pairs: list[tuple]) -> dict:
    """A JSON object without repeated keys (json.loads would keep the last one silently)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"'{key}' appears twice in the header")
        out[key] = value
    return out


def _entry(file: Path, name: str, info, data_start: int, data_size: int) -> TensorEntry:
    """One header entry, checked: what is wrong is named with the file and the tensor."""
    def bad(what: str) -> TiermoeError:
        return TiermoeError(f"{file}: tensor {name} {what}; the file is corrupt or not safetensors")

    if not isinstance(info, dict):
        raise bad("is not a JSON object with dtype, shape and data_offsets")
    dtype = SAFETENSORS_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise TiermoeError(f"{file}: tensor {name} has unsupported dtype {info.get('dtype')!r}; tiermoe reads "
                           f"{', '.join(SAFETENSORS_DTYPES)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"has shape {shape!r}, expected a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise bad(f"has data_offsets {offsets!r}, expected [begin, end] integers")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise bad(f"has data_offsets [{begin}, {end}]: negative or reversed")
    if end > data_size:
        raise bad(f"has data_offsets [{begin}, {end}] past the end of the data section ({data_size} bytes)")
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise bad(f"holds {end - begin} bytes, but shape {shape} of {info['dtype']} is {nbytes} bytes")
    return TensorEntry(file, dtype, tuple(shape), data_start + begin, nbytes)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_no_overlap(file: Path, entries: dict[str, TensorEntry]) -> None:
    """Two tensors sharing bytes: one of them (at least) reads the other's weights."""
    previous = None
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].offset, item[1].nbytes)):
        if entry.nbytes == 0:
            continue
        if previous is not None and entry.offset < previous[1].offset + previous[1].nbytes:
            raise TiermoeError(f"{file}: tensor {name} overlaps tensor {previous[0]} in the data section; "
                               "the file is corrupt")
        previous = (name, entry)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by `model.safetensors.index.json`, else all of them."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise TiermoeError(f"{index} is malformed ({err}); expected a JSON object with 'weight_map'") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise TiermoeError(f"{index} names shard files that are missing: {', '.join(missing[:5])}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TiermoeError(f"'{model_dir}' has no *.safetensors weights; expected model.safetensors or sharded files")
    return files


class TensorIndex:
    """What the loader asks of any checkpoint: `entries` (name -> an entry with dtype, shape, nbytes), membership,
    shapes, and closing as a context manager. Checkpoint (safetensors) and GGUFCheckpoint implement `read`."""

    entries: dict

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        pass

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape


class Checkpoint(TensorIndex):
    """All tensors of a checkpoint directory, by name, with bounded-memory reads.

    Use as a context manager so that file handles are closed after loading.
    """

    def __init__(self, model_dir: str | Path, fp8_block: tuple[int, int] | None = None):
        self.model_dir = Path(model_dir)
        self.fp8_block = fp8_block or DEFAULT_BLOCK  # weight_block_size of FP8 tensors (config.json)
        self.entries: dict[str, TensorEntry] = {}
        for file in checkpoint_files(self.model_dir):
            for name, entry in read_header(file).items():
                if name in self.entries:
                    raise TiermoeError(f"{file}: tensor {name} is also in {self.entries[name].file.name}; "
                                       "a checkpoint holds each tensor once")
                self.entries[name] = entry
        self._handles: dict[Path, object] = {}

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def read(self, name: str, out: torch.Tensor | None = None, index: int | None = None) -> torch.Tensor:
        """Read tensor `name` (or its slice `[index]` along dim 0) into `out`, a contiguous CPU tensor.

        When `out` has another dtype than the file, the bytes go through a temporary of the file's dtype; FP8
        tensors with block scales are dequantised into a non-FP8 `out`. Returns `out` (allocated when None, in
        the file's dtype).
        """
        entry = self.entries[name]
        if (entry.dtype in FP8_DTYPES and out is not None and out.dtype not in FP8_DTYPES
                and scale_name(name) in self.entries):
            return self._read_fp8(name, out, index)
        shape, offset, nbytes = entry.shape, entry.offset, entry.nbytes
        if index is not None:
            rows = shape[0]
            if not 0 <= index < rows:
                raise IndexError(f"{name}: index {index} outside its first dimension of {rows}")
            nbytes //= rows
            offset += index * nbytes
            shape = shape[1:]
        if out is None:
            out = torch.empty(shape, dtype=entry.dtype)
        if tuple(out.shape) != tuple(shape):
            raise TiermoeError(f"{self.model_dir}: tensor {name} has shape {list(shape)}, expected {list(out.shape)}")
        target = out if out.dtype == entry.dtype else torch.empty(shape, dtype=entry.dtype)
        self._read_bytes(entry.file, offset, nbytes, target)
        if target is not out:
            out.copy_(target)
        return out

    def _read_fp8(self, name: str, out: torch.Tensor, index: int | None) -> torch.Tensor:
        codes = self.read(name, index=index)
        if codes.dim() != 2:
            raise TiermoeError(f"{self.model_dir}: FP8 tensor {name} has {codes.dim()} dims after slicing, expected 2")
        if tuple(codes.shape) != tuple(out.shape):
            raise TiermoeError(f"{self.model_dir}: tensor {name} has shape {list(codes.shape)}, expected {list(out.shape)}")
        scale = self.read(scale_name(name), index=index)
        return dequantize_fp8(codes, scale, self.fp8_block, out.dtype, out=out)

    def _read_bytes(self, file: Path, offset: int, nbytes: int, out: torch.Tensor) -> None:
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("Checkpoint.read needs a contiguous CPU destination")
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = open(file, "rb", buffering=0)
        handle.seek(offset)
        done = 0
        while done < nbytes:
            got = handle.readinto(view[done:])
            if not got:
                raise TiermoeError(f"{file} ends early: expected {nbytes} bytes at offset {offset}")
            done += got
