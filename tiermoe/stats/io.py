"""Statistics files: reading them (SGLang's recorder dumps, KTransformers' collector output, plain tensors,
tiermoe's own dumps), writing tiermoe's in SGLang's layouts (tiermoe.stats.sglang_files), and where dumps go.

Every file is loaded with torch.load(weights_only=True): statistics are data, not code. Accepted:
- a dict with `logical_count` [buf, num_hidden_layers, E] (SGLang's `--init-expert-location` format, and
  tiermoe's own), summed over the first dimension;
- a dict with `activation_counts` [L, E] (KTransformers' collect_expert_distribution.py);
- SGLang's per_pass / per_token files (`records`, tiermoe.stats.sglang_records), summed over their passes;
- a bare tensor [L, E] or [buf, L, E];
- the text formats (tiermoe.stats.text_files): a routing trace CSV `seq,pos,layer,experts` and a heat matrix CSV
  `layer,e0,...` (docs/traces.md), read into the dicts above.
A file holding only `gpu_expert_masks` (SGLang-kt's `gpu_expert_distribution_{time}.pt`) joins `load_stats` as the
GPU-tier snapshots of the run; the one beside a counts file (same time stamp) is picked up by itself.
`load_counts` gives the placement planner a checked [L, E] table; `load_stats` reads and merges whole files
(metadata, prefill/decode split) into an ExpertStats; `save_stats` writes a recorder's dump.

Dumps without an explicit path go to $TIERMOE_EXPERT_DISTRIBUTION_RECORDER_DIR, else
$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp (SGLang's default), named as SGLang names them:
`expert_distribution_recorder_{unix time}.pt` (stat), `expert_distribution_recorder_{unix time}_{rank}.pt`
(per_pass, per_token), GPU-tier snapshots in `gpu_expert_distribution_{unix time}.pt` beside them.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

import torch

from tiermoe.errors import TiermoeError
from tiermoe.stats.expert_stats import (
    ExpertStats,
    check_counts,
    check_shape,
    merge,
    stats_from_data,
)
from tiermoe.stats.sglang_files import DETAIL_MODES, sglang_files
from tiermoe.stats.sglang_records import from_records, is_records_file
from tiermoe.stats.text_files import is_text_file, read_text_statistics

OUTPUT_DIR_VARIABLES = ("TIERMOE_EXPERT_DISTRIBUTION_RECORDER_DIR", "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR")
SGLANG_DEFAULT_DIR = "/tmp"
COUNTS_PREFIX, MASKS_PREFIX = "expert_distribution_recorder_", "gpu_expert_distribution_"


def load_counts(path: str | Path, num_layers: int, num_experts: int) -> torch.Tensor:
    """Activation counts [num_layers, num_experts] (float64) from a statistics file, checked against the model."""
    path = Path(path)
    data = _load_file(path)
    counts = _counts_tensor(data, path)
    check_counts(counts, str(path))
    expected = f"[buf, {num_layers}, {num_experts}] or [{num_layers}, {num_experts}]"
    if counts.dim() == 3:
        if tuple(counts.shape[1:]) != (num_layers, num_experts):
            raise TiermoeError(f"'{path}' holds counts of shape {list(counts.shape)}; expected {expected} "
                               "(num_hidden_layers x experts of this model)")
        counts = counts.sum(dim=0)
    elif counts.dim() == 2:
        if tuple(counts.shape) != (num_layers, num_experts):
            raise TiermoeError(f"'{path}' holds counts of shape {list(counts.shape)}; expected {expected} "
                               "(num_hidden_layers x experts of this model)")
    else:
        raise TiermoeError(f"'{path}' holds a {counts.dim()}-D tensor of shape {list(counts.shape)}; expected {expected}")
    return counts.to(torch.float64)


def _counts_tensor(data, path: Path) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data
    if isinstance(data, dict):
        for key in ("logical_count", "activation_counts"):
            if isinstance(data.get(key), torch.Tensor):
                return data[key]
        if is_records_file(data):
            return from_records(data, str(path))["logical_count"]
        raise TiermoeError(f"'{path}' is a dict without 'logical_count' or 'activation_counts' "
                           f"(keys: {', '.join(map(str, list(data)[:8]))})")
    raise TiermoeError(f"'{path}' holds a {type(data).__name__}; expected a dict with 'logical_count' or a tensor")


def _load_file(path: Path):
    """A statistics file's contents: a `.pt` (torch.load, weights only) or a trace / heat-matrix CSV."""
    if not path.is_file():
        raise TiermoeError(f"statistics file '{path}' does not exist")
    if is_text_file(path):
        return read_text_statistics(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure is a bad file for the user
        raise TiermoeError(f"'{path}' is not a statistics file torch can load safely ({type(err).__name__}: "
                           f"{(str(err).splitlines() or [''])[0][:200]})") from None


def load_trace(path: str | Path) -> dict:
    """A per_token trace (a `tiermoe record --mode per_token` dump or a trace CSV) as its dict; replay checks the
    fields it reads."""
    path = Path(path)
    try:
        data = _load_file(path)
    except TiermoeError as err:
        raise TiermoeError(f"cannot load trace: {err}") from None
    if isinstance(data, dict) and data.get("source_kind") == "heat csv":
        raise TiermoeError(f"'{path}' is a heat matrix (counts per layer and expert), not a per-token trace")
    return data


def load_stats(paths: str | Path | Iterable[str | Path], num_layers: int | None = None,
               num_experts: int | None = None) -> ExpertStats:
    """Read one or several statistics files (any format above) and merge them into one ExpertStats.

    Args:
        paths: a file or several (their counts are summed; they must share [layers, experts]).
        num_layers, num_experts: the model's num_hidden_layers and experts, if known: a file recorded on another
            model is rejected with one error naming the expected and found shapes.
    """
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    parts, masks = [], []
    for path in paths:
        data = _load_file(Path(path))
        if _is_masks_file(data):
            masks.append(passes_of_masks(data))
            continue
        stats = stats_from_data(data, str(path))
        check_shape(stats, num_layers, num_experts)
        parts.append(stats)
        beside = gpu_masks_path(Path(path))
        if stats.gpu_masks_PLE is None and len(paths) == 1 and beside.is_file():
            beside_data = _load_file(beside)
            if _is_masks_file(beside_data):
                masks.append(passes_of_masks(beside_data))
    stats = merge(parts)
    if masks and len(parts) == 1 and all(isinstance(m, torch.Tensor) for m in masks):
        stats = replace(stats, gpu_masks_PLE=torch.cat(masks))
    return stats


def passes_of_masks(data: dict) -> torch.Tensor:
    """The recorded passes' masks [P, L, E], oldest first: a circular buffer's slots put back in pass order and its
    unfilled slots left out when the file says which pass each slot holds (tiermoe's `..._pass_index`)."""
    masks, index = data["gpu_expert_masks"], data.get("gpu_expert_masks_pass_index")
    if not isinstance(index, torch.Tensor) or index.shape != masks.shape[:1]:
        return masks
    filled = (index >= 0).nonzero().flatten()
    return masks[filled[index[filled].argsort()]]


def _is_masks_file(data) -> bool:
    return isinstance(data, dict) and isinstance(data.get("gpu_expert_masks"), torch.Tensor) and not (
        "logical_count" in data or "records" in data or "activation_counts" in data)


def gpu_masks_path(counts_path: Path) -> Path:
    """Where the GPU-tier snapshots of a counts file go: SGLang-kt's `gpu_expert_distribution_{time}.pt` for
    `expert_distribution_recorder_{time}[_{rank}].pt`, else `gpu_expert_distribution_{stem}.pt`, same folder."""
    stem = counts_path.stem
    if stem.startswith(COUNTS_PREFIX):
        stem = re.sub(r"^(\d+(?:\.\d+)?)_\d+$", r"\1", stem[len(COUNTS_PREFIX):])
    return counts_path.with_name(f"{MASKS_PREFIX}{stem}.pt")


def recorder_output_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where dumps go when no path is given (see the module docstring)."""
    environ = os.environ if environ is None else environ
    for name in OUTPUT_DIR_VARIABLES:
        if environ.get(name):
            return Path(environ[name])
    return Path(SGLANG_DEFAULT_DIR)


def default_dump_path(environ: Mapping[str, str] | None = None, mode: str | None = None, rank: int = 0) -> Path:
    """SGLang's name: per_pass and per_token files end in `_{rank}`, stat files do not."""
    suffix = f"_{rank}" if mode in DETAIL_MODES else ""
    return recorder_output_dir(environ) / f"{COUNTS_PREFIX}{time.time()}{suffix}.pt"


def save_stats(dump: dict, path: str | Path | None = None) -> Path:
    """Write a recorder's dump (a dict with `logical_count`) in SGLang's layout for its mode; returns the path of
    the counts file (GPU-tier snapshots, if the dump has them, go to gpu_masks_path() of it: write_dump says both).
    """
    return write_dump(dump, path)[0]


def write_dump(dump: dict, path: str | Path | None = None) -> list[Path]:
    """save_stats, returning every file written: the counts file, then the GPU masks file if any.

    path None: default_dump_path() for the dump's mode. Directories are created if missing; each file is written
    under a temporary name and renamed, so a reader never sees half a file.
    """
    if not isinstance(dump, dict) or not isinstance(dump.get("logical_count"), torch.Tensor):
        raise ValueError("save_stats expects a recorder dump: a dict with a 'logical_count' tensor")
    path = Path(path) if path is not None else default_dump_path(mode=dump.get("mode"))
    counts, masks = sglang_files(dump)
    written = [path]
    _save(counts, path)
    if masks is not None:
        written.append(gpu_masks_path(path))
        _save(masks, written[-1])
    return written


def _save(data: dict, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        torch.save(data, partial)
        partial.replace(path)
    except OSError as err:
        raise TiermoeError(f"cannot write statistics to '{path}': {err.strerror or err}") from None


def dump_recorder(recorder, path: str | Path | None = None, run: dict | None = None) -> Path:
    """Dump a recorder (stat, per_pass, per_token, with or without GPU-tier snapshots) to a file.

    run: optional plain-value description of the run (dataset, prompts, seed, ...), stored under "run".
    """
    return dump_recorder_files(recorder, path, run)[0]


def dump_recorder_files(recorder, path: str | Path | None = None, run: dict | None = None) -> list[Path]:
    """dump_recorder, returning every file written (the counts file, then the GPU masks file if any)."""
    dump = recorder.dump()
    if run:
        dump["run"] = dict(run)
    return write_dump(dump, path)
