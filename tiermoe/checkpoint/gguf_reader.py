"""GGUF files (llama.cpp's format) read with the `gguf` package: which files, their metadata, their tensors.

A model is one `.gguf` file or a directory of split files (`name-00001-of-00003.gguf`, ...); the gguf
package memory-maps each file, and a tensor is dequantised only when asked for, in row chunks (or one expert
slice of a merged `[E, ...]` expert tensor), so memory stays bounded whatever the file size.
Supported tensor types: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K (decoded by tiermoe.checkpoint.gguf_dequant).
"""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGUFReader, GGUFValueType

from tiermoe.checkpoint.gguf_dequant import dequantize_into
from tiermoe.errors import TiermoeError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_CHUNK_BYTES = 64 << 20  # fp32 rows dequantised at once


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
            try:
                reader = GGUFReader(file, "r")
            except (ValueError, OSError) as err:
                raise TiermoeError(f"{file} is not a valid GGUF file ({err})") from None
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
