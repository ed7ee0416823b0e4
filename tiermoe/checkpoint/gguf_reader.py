"""GGUF files (llama.cpp's format) read with the `gguf` package: which files, their metadata, their tensors.

A model is one `.gguf` file or a directory of split files (`name-00001-of-00003.gguf`, ...); the gguf
package memory-maps each file, and a tensor is dequantised only when asked for, in row chunks (or one expert
slice of a merged `[E, ...]` expert tensor), so memory stays bounded whatever the file size.
Supported tensor types: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K (decoded by tiermoe.checkpoint.gguf_dequant).

A file is not trusted: the gguf package reads past the end of a file without complaint (an empty read, then an
IndexError or a loop as long as a corrupt count) and raises assorted exceptions on malformed fields. So its reads are
bounded by the file, its counts by what the file can hold, every exception it raises on a bad file becomes one
line naming the file, and what it returns is checked: tensors inside the file and not sharing bytes, and no
metadata size larger than the tensors could hold (a corrupt layer count would otherwise loop for minutes).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType

from tiermoe.checkpoint.gguf_dequant import dequantize_into
from tiermoe.errors import TiermoeError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_CHUNK_BYTES = 64 << 20  # fp32 rows dequantised at once
# what the gguf package raises on a malformed file (short reads, unknown enum values, impossible shapes, ...)
_MALFORMED = (ValueError, KeyError, IndexError, TypeError, OverflowError, OSError, MemoryError)
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, dimension count, type, offset


def gguf_files(path: str | Path) -> list[Path]:
    """The GGUF files of `path`: the file itself, or every `*.gguf` in a directory (sorted); [] when none."""
    path = Path(path)
    if path.is_file():
        return [path] if path.suffix == ".gguf" else []
    if path.is_dir():
        return sorted(path.glob("*.gguf"))
    return []


def _scalar(field):
    """A metadata field's value when it is a scalar or a string (arrays are left out, except their length)."""

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        return None
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8", errors="replace")
    return value.tolist()[0] if hasattr(value, "tolist") else value


class _BoundedReader(GGUFReader):
    """The gguf package's reader, refusing (ValueError) any read past the end of the file and any array whose
    length the rest of the file cannot hold, instead of reading nothing and going on."""

    def _get(self, offset, dtype, count=1, override_order=None):
        offset, count = int(offset), int(count)
        end = offset + np.dtype(dtype).itemsize * count
        if offset < 0 or count < 0 or end > len(self.data):
            raise ValueError(f"{count} values at byte {offset} run past the end of the file ({len(self.data)} bytes)")
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == GGUFValueType.ARRAY:
            item_type = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
            length = int(self._get(orig_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(item_type)
            least = np.dtype(scalar).itemsize if scalar is not None else 8  # a string or array: its length
            if length * least > len(self.data) - orig_offs - 12:
                raise ValueError(f"an array of {length} items at byte {orig_offs} is longer than the file")
        return super()._get_field_parts(orig_offs, raw_type)


def _check_counts(file: Path) -> None:
    """Tensor and metadata counts the file's size can hold (read before the gguf package loops over them)."""
    with open(file, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        return  # the gguf package names what is wrong
    order = "<" if struct.unpack("<I", head[4:8])[0] & 0xFFFF else ">"  # the version tells the byte order
    tensors, kvs = struct.unpack(order + "QQ", head[8:24])
    size = file.stat().st_size
    if tensors * _MIN_TENSOR_INFO_BYTES + kvs * _MIN_KV_BYTES > size - 24:
        raise TiermoeError(f"{file} is not a valid GGUF file (its tensor count {tensors} and metadata count {kvs} "
                           f"are more than its {size} bytes can hold)")


def _check_tensors(file: Path, reader: GGUFReader) -> None:
    """Every tensor's bytes inside the file, no two sharing bytes: else one reads another's weights."""
    size, previous = len(reader.data), None
    for t in sorted(reader.tensors, key=lambda t: (int(t.data_offset), int(t.n_bytes))):
        begin, end = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise TiermoeError(f"{file}: GGUF tensor {t.name} lies past the end of the file; the file is corrupt")
        if previous is not None and begin < previous[1] and end > begin:
            raise TiermoeError(f"{file}: GGUF tensor {t.name} overlaps tensor {previous[0]}; the file is corrupt")
        if end > begin:
            previous = (t.name, end)


class GGUFFiles:
    """Metadata and tensors of one GGUF model (all its split files), by GGUF name."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        files = gguf_files(self.path)
        if not files:
            raise TiermoeError(f"'{self.path}' is not a .gguf file nor a directory holding any")
        self.metadata: dict = {}
        self.tensors: dict = {}
        self.file_of: dict[str, Path] = {}  # GGUF tensor name -> the split file holding it
        for file in files:
            _check_counts(file)
            try:
                reader = _BoundedReader(file, "r")
            except _MALFORMED as err:
                raise TiermoeError(f"{file} is not a valid GGUF file ({err})") from None
            _check_tensors(file, reader)
            for key, field in reader.fields.items():
                if key.startswith(("GGUF.", "split.")):
                    continue
                if key == "tokenizer.ggml.tokens":
                    self.metadata["tokenizer.ggml.tokens_count"] = len(field.data)
                    continue
                value = _scalar(field)
                if value is not None:
                    self.metadata.setdefault(key, value)
            for t in reader.tensors:
                self.tensors[t.name] = t
                self.file_of[t.name] = file
        embd = self.tensors.get("token_embd.weight")
        if embd is not None:
            self.metadata["_token_embd_rows"] = int(embd.shape[-1])
        self._check_sizes()

    def _check_sizes(self) -> None:
        """Metadata sizes the tensors could hold: a layer count beyond the number of tensors, or a width, head or
        expert count beyond the largest tensor's elements, is a corrupt value (it would size loops and buffers)."""
        arch = self.architecture
        largest = max((int(t.n_elements) for t in self.tensors.values()), default=0)
        where = self.path
        for key, value in self.metadata.items():
            if not key.startswith(f"{arch}.") or not isinstance(value, int) or isinstance(value, bool):
                continue
            if key == f"{arch}.block_count" and value > len(self.tensors):
                raise TiermoeError(f"{where}: GGUF metadata {key} = {value} is more than the file's "
                                   f"{len(self.tensors)} tensors could hold; the file is corrupt")
            if "context_length" not in key and value > largest:
                raise TiermoeError(f"{where}: GGUF metadata {key} = {value} is more than the largest tensor's "
                                   f"{largest} elements; the file is corrupt")
        used, experts = self.metadata.get(f"{arch}.expert_used_count"), self.metadata.get(f"{arch}.expert_count")
        if isinstance(used, int) and isinstance(experts, int) and used > experts:
            raise TiermoeError(f"{where}: GGUF metadata {arch}.expert_used_count = {used} is more than "
                               f"{arch}.expert_count = {experts}; the file is corrupt")

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in torch order (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def nbytes(self, name: str) -> int:
        return int(self.tensors[name].n_bytes)

    def read(self, name: str, index: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` (or its slice [index] along the outermost dim) dequantised, torch order: into `out`
        (contiguous, any float dtype, chunk by chunk: no full fp32 copy) or a new fp32 tensor."""
        t = self.tensors[name]
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise TiermoeError(f"GGUF tensor {name} is {kind}; tiermoe reads {', '.join(SUPPORTED_TYPES)}")
        data = t.data if index is None else t.data[index]
        shape = self.shape(name) if index is None else self.shape(name)[1:]
        rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
        row_elems = shape[-1] if shape else 1
        if out is None:
            out = torch.empty(shape, dtype=torch.float32)
        if tuple(out.shape) != tuple(shape) or not out.is_contiguous():
            raise TiermoeError(f"GGUF tensor {name}: destination {list(out.shape)} does not match {list(shape)}")
        out_rows = out.view(-1, row_elems)
        step = max(1, _CHUNK_BYTES // (4 * row_elems))
        for start in range(0, rows.shape[0], step):
            dequantize_into(rows[start:start + step], t.tensor_type, out_rows[start:start + step])
        return out
