"""GGUF files (llama.cpp's format) read with the `gguf` package: which files, their metadata, their tensors.

A model is one `.gguf` file or a directory of split files (`name-00001-of-00003.gguf`, ...); the gguf
package memory-maps each file, and a tensor is dequantised only when asked for, one expert slice at a time for
the merged `[E, ...]` expert tensors, so memory stays bounded whatever the file size.
"""

from __future__ import annotations

from pathlib import Path


def gguf_files(path: str | Path) -> list[Path]:
    """The GGUF files of `path`: the file itself, or every `*.gguf` in a directory (sorted); [] when none."""
    path = Path(path)
    if path.is_file():
        return [path] if path.suffix == ".gguf" else []
    if path.is_dir():
        return sorted(path.glob("*.gguf"))
    return []
