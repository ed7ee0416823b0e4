"""The CPU-expert cache that `tiermoe convert` writes: every routed expert already in a CPU-tier format.

Layout of the cache directory:
  tiermoe-cpu-experts.json   manifest: format, layout, compute dtype, where the source's weights are (`source`,
                             relative to the directory) and their fingerprint
  layer-NNN.safetensors      one file per MoE layer: `{e}.gate_up.codes`, `{e}.gate_up.scale`, ... per expert
  source/                    the source's weight files (hard links or copies: tiermoe.convert) and its model card;
                             non-expert weights and GPU-tier experts load from here, so the source may move or go
  config.json, tokenizer...  copied from the source, so the directory is what `--model` points at
  README.md                  what was converted, how, and from what

Each layer file is written as a stream (header first, computed from the first expert's shapes, then expert after
expert), so converting holds one expert at a time. Loading memory-maps the files copy-on-write: the CPU tier's
tensors are the file's pages, read in by the kernel as they are touched, never converted again. The stored
layout is the one the native kernels compute with ("blocked") when they were available at conversion, so the
tier holds the mapped tensors as they are; a machine without the kernels re-lays them out once ("rows").
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tiermoe.checkpoint.safetensors import SAFETENSORS_DTYPES, read_header
from tiermoe.errors import TiermoeError
from tiermoe.experts.quant import QMatrix

MANIFEST = "tiermoe-cpu-experts.json"
# 2: int4's blocked codes in chunks of 4 lines interleaved by row (csrc/tm_kernels.h), int6, a down format of its own;
# a version-1 cache is read unless it holds blocked int4 codes (their order changed)
VERSION = 2
SOURCE_DIR = "source"  # the cache's own copy of the source's weights, as the manifest names it (relative)
_FIELDS = ("codes", "scale", "gscale", "gzero")
_DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def layer_file(layer: int) -> str:
    return f"layer-{layer:03d}.safetensors"


def source_fingerprint(files: list[Path]) -> list[list]:
    """(name, size, mtime in ns) of each source file: a changed source makes the cache stale."""
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def expert_tensors(expert: int, gate_up: QMatrix, down: QMatrix, gate_up_bias=None, down_bias=None) -> dict:
    """The named tensors one expert is stored as."""
    out = {}
    for which, m in (("gate_up", gate_up), ("down", down)):
        for field in _FIELDS:
            t = getattr(m, field)
            if t is not None:
                out[f"{expert}.{which}.{field}"] = t.contiguous()
    for which, b in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if b is not None:
            out[f"{expert}.{which}"] = b.contiguous()
    return out


def matrix_meta(m: QMatrix) -> dict:
    """What a QMatrix needs beyond its tensors (the same for every expert of a model)."""
    return {"fmt": m.fmt, "layout": m.layout, "n": m.n, "k": m.k, "segments": [list(s) for s in m.segments],
            "segment_rows": m.segment_rows}


class StreamingLayerWriter:
    """A safetensors file written tensor by tensor: the header (all names, dtypes, shapes) is known up front."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        header, offset = {}, 0
        for name, dtype, shape in specs:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
        self._order = [(name, dtype, tuple(shape)) for name, dtype, shape in specs]
        self._next = 0
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self.path = path

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            want = self._order[self._next]
            if (name, t.dtype, tuple(t.shape)) != want:
                raise ValueError(f"{self.path}: expected {want} next, got {(name, t.dtype, tuple(t.shape))}")
            self._file.write(t.contiguous().view(torch.uint8).numpy().tobytes())
            self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._next} tensors were never written")


@dataclass
class ExpertCache:
    """A converted cache directory: read experts (memory-mapped) in the stored format."""

    root: Path
    manifest: dict

    @property
    def fmt(self) -> str:
        return self.manifest["format"]

    @property
    def down_fmt(self) -> str:
        """The experts' down projections' format (caches written before it could differ hold them in `fmt`)."""
        return self.manifest.get("down_format", self.fmt)

    @property
    def source(self) -> Path:
        """The weights converted from: the cache's own `source/` folder, named relative to the cache so that it
        moves with it (an absolute path, as caches written before they stood alone name it, is kept as it is)."""
        return self.root / self.manifest["source"]

    def check_source(self, files: list[Path]) -> None:
        """Refuse a cache whose source changed since conversion (one line, naming the fix)."""
        if source_fingerprint(files) != self.manifest["source_fingerprint"]:
            raise TiermoeError(f"the CPU-expert cache in {self.root} was converted from other weights than "
                               f"{self.source} holds now; run `tiermoe convert` again")

    def __post_init__(self):
        self._maps: dict[int, tuple[mmap.mmap, dict]] = {}

    def _layer(self, layer: int):
        if layer not in self._maps:
            path = self.root / layer_file(layer)
            if not path.is_file():
                raise TiermoeError(f"the CPU-expert cache {self.root} lacks {path.name}; run `tiermoe convert` again")
            entries = read_header(path)
            with open(path, "rb") as f:
                self._maps[layer] = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), entries)
        return self._maps[layer]

    def _tensor(self, layer: int, name: str) -> torch.Tensor | None:
        mm, entries = self._layer(layer)
        entry = entries.get(name)
        if entry is None:
            return None
        if entry.offset % entry.dtype.itemsize:  # unaligned for this dtype: a copy instead of a view
            return torch.frombuffer(bytearray(mm[entry.offset:entry.offset + entry.nbytes]), dtype=entry.dtype
                                    ).view(entry.shape)
        return torch.frombuffer(mm, dtype=entry.dtype, count=entry.numel, offset=entry.offset).view(entry.shape)

    def read(self, layer: int, expert: int) -> tuple[QMatrix, QMatrix, torch.Tensor | None, torch.Tensor | None]:
        """Expert `expert` of `layer`: (gate_up, down, gate_up_bias, down_bias), tensors mapped from the file."""
        mats = []
        for which in ("gate_up", "down"):
            meta = self.manifest["matrices"][which]
            fields = {f: self._tensor(layer, f"{expert}.{which}.{f}") for f in _FIELDS}
            if fields["codes"] is None:
                raise TiermoeError(f"the CPU-expert cache {self.root} lacks expert {expert} of layer {layer}")
            mats.append(QMatrix(meta["fmt"], meta["layout"], meta["n"], meta["k"], fields["codes"], fields["scale"],
                                fields["gscale"], fields["gzero"], tuple(tuple(s) for s in meta["segments"]),
                                meta["segment_rows"]))
        return (mats[0], mats[1], self._tensor(layer, f"{expert}.gate_up_bias"),
                self._tensor(layer, f"{expert}.down_bias"))


def find_cache(model_dir: str | Path) -> ExpertCache | None:
    """The cache `model_dir` is, or None when it is a plain checkpoint."""
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise TiermoeError(f"{path} is not valid JSON ({err}); run `tiermoe convert` again") from None
    if not isinstance(manifest, dict):
        raise TiermoeError(f"{path} is not a JSON object; run `tiermoe convert` again")
    if manifest.get("version") not in (1, VERSION):
        raise TiermoeError(f"{path} is a cache of version {manifest.get('version')}, this tiermoe reads {VERSION}; "
                           "run `tiermoe convert` again")
    _check_manifest(path, manifest)
    matrices = manifest["matrices"].values()
    if manifest["version"] == 1 and any(m["fmt"] == "int4" and m["layout"] == "blocked" for m in matrices):
        raise TiermoeError(f"{path} holds int4 experts in the layout of cache version 1 (the kernels read each 4 "
                           "lines interleaved by row since version 2); run `tiermoe convert` again")
    return ExpertCache(Path(model_dir), manifest)


_MANIFEST_FIELDS = {"format": str, "source": str, "source_fingerprint": list, "matrices": dict}
_MATRIX_FIELDS = {"fmt": str, "layout": str, "n": int, "k": int, "segments": list, "segment_rows": (int, type(None))}


def _check_manifest(path: Path, manifest: dict) -> None:
    """Every field a load reads, of its type: an edited or damaged manifest is one line, not a KeyError later."""
    wrong = [key for key, kind in _MANIFEST_FIELDS.items() if not isinstance(manifest.get(key), kind)]
    matrices = manifest.get("matrices") if isinstance(manifest.get("matrices"), dict) else {}
    for which in ("gate_up", "down"):
        meta = matrices.get(which)
        if not isinstance(meta, dict):
            wrong.append(f"matrices.{which}")
            continue
        wrong += [f"matrices.{which}.{key}" for key, kind in _MATRIX_FIELDS.items()
                  if not isinstance(meta.get(key), kind)]
    if wrong:
        raise TiermoeError(f"{path} lacks or mistypes {', '.join(sorted(set(wrong)))}; run `tiermoe convert` again")
