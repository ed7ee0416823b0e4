"""`tiermoe convert`: write every routed expert in a CPU-tier format once, so later loads map it instead.

The experts stream from the source (safetensors in any dtype, FP8 block-quantised, or GGUF) one at a time:
read (dequantised to the compute dtype), quantised to `fmt` (tiermoe.experts.quant, the CPU tier's own code),
laid out for the native kernels when this machine has them, and written, so memory stays about one expert
whatever the model size. Everything is written into a temporary directory beside `out`, renamed to `out` only
once complete: a failed or interrupted conversion (Ctrl-C included) removes it and leaves `out` as it was, so the
rerun starts clean.

The output stands alone, so it survives the source being moved or deleted: the source's weight files (the
non-expert weights, and the experts a GPU tier takes in their original format) go into its `source/` folder,
hard-linked when `out` is on the source's filesystem, else copied (tiermoe.checkpoint.weight_copy), and the
manifest names that folder relative to the output. Its README.md says what the conversion was; the source's own
model card (license, intended use), when it had one, travels as `source/README.md`.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from gguf import GGUFReader
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from tiermoe.arch import detect, load_config
from tiermoe.checkpoint.expert_cache import (
    MANIFEST,
    SOURCE_DIR,
    VERSION,
    StreamingLayerWriter,
    expert_tensors,
    layer_file,
    matrix_meta,
    source_fingerprint,
)
from tiermoe.checkpoint.fp8 import fp8_block_size
from tiermoe.checkpoint.gguf_reader import gguf_files
from tiermoe.checkpoint.weight_copy import link_or_copy
from tiermoe.config import CPUConfig, expert_down_format
from tiermoe.errors import TiermoeError
from tiermoe.experts.kernels import load_kernels
from tiermoe.experts.quant import FORMATS, expert_in_layout, kernels_take_shape, quantize
from tiermoe.model.expert_source import LAYERS_PREFIX, find_expert_source, read_expert
from tiermoe.model.gguf_checkpoint import open_checkpoint, weight_files

MODEL_CARD = "README.md"
_INDEX = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def kernel_layout(fmt: str, spec) -> bool:
    """Whether the native CPU tier of this machine computes these experts from the "blocked" layout (the rule
    NativeCPUExperts applies: kernels available, SiLU-GLU experts, and bf16 only for shapes in multiples of 32)."""

    if spec.activation != "silu_glu" or load_kernels() is None:
        return False
    return kernels_take_shape(fmt, spec.hidden_size, spec.expert_intermediate_size)


def convert_cpu_experts(model: str | Path, fmt: str, out: str | Path, dtype: torch.dtype | None = None,
                        progress: bool = True, down_fmt: str | None = None) -> Path:
    """Write all routed experts of `model` in CPU format `fmt` ("bf16" | "int8" | "int4" | "int6"), their down
    projections in `down_fmt` (None: as the loader holds them, CPUConfig.down_format: int6 under int4), to `out`,
    with the source's weights beside them (`out/source/`)."""
    src, out = Path(model).resolve(), Path(out)
    if fmt not in FORMATS:
        raise TiermoeError(f"--cpu-expert-dtype '{fmt}' is unknown; choose one of: {', '.join(FORMATS)}")
    down_fmt = CPUConfig(expert_dtype=fmt, expert_down_dtype=down_fmt).down_format  # says what a bad pair is
    if out.exists() and not out.is_dir():
        raise TiermoeError(f"output '{out}' exists and is not a directory; choose a new directory")
    if out.exists() and any(out.iterdir()):
        raise TiermoeError(f"output directory '{out}' exists and is not empty; choose a new one")
    if (src / MANIFEST).is_file():
        raise TiermoeError(f"'{src}' is already a converted cache; convert from the original checkpoint")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"  # beside `out`: same filesystem, so rename works
    shutil.rmtree(partial, ignore_errors=True)  # left by a killed run of an earlier process with this id
    partial.mkdir()
    try:
        _write_cache(src, fmt, down_fmt, partial, dtype, progress)
        os.replace(partial, out)  # atomic; replaces `out` only when it is an empty directory
    except BaseException:  # a failure or Ctrl-C: nothing half-written stays behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _write_cache(src: Path, fmt: str, down_fmt: str, out: Path, dtype: torch.dtype | None, progress: bool) -> None:
    """The whole cache of `src` written into the (empty) directory `out`."""
    config = load_config(src)
    spec = detect(config)
    dtype = dtype or spec.dtype
    layout = "blocked" if kernel_layout(fmt, spec) else "rows"
    # the weights first: a disk too small to hold their copy is said before the long conversion, not after
    placed = _place_source_weights(src, out / SOURCE_DIR, progress)
    total = spec.total_routed_experts
    metas = None
    with open_checkpoint(src, config, fp8_block_size(config)) as ckpt, \
            tqdm(total=total, unit="expert", desc=f"converting {src.name} to {fmt}", disable=not progress) as bar:
        for layer in spec.moe_layers:
            source = find_expert_source(ckpt, spec, LAYERS_PREFIX, layer)
            writer = None
            for e in range(spec.num_experts):
                w = read_expert(ckpt, source, e, spec, dtype)
                gate_up, down = expert_in_layout(quantize(w.gate_up, fmt), quantize(w.down, down_fmt), layout)
                tensors = expert_tensors(e, gate_up, down, w.gate_up_bias, w.down_bias)
                if writer is None:  # every expert has expert 0's shapes: the header is known now
                    specs = [(f"{x}.{name.split('.', 1)[1]}", t.dtype, tuple(t.shape))
                             for x in range(spec.num_experts) for name, t in tensors.items()]
                    writer = StreamingLayerWriter(out / layer_file(layer), specs)
                    metas = {"gate_up": matrix_meta(gate_up), "down": matrix_meta(down)}
                writer.write(tensors)
                bar.update(1)
            writer.close()
    _copy_side_files(src, out, config)
    dtype_name = str(dtype).removeprefix("torch.")
    manifest = {"version": VERSION, "format": fmt, "down_format": down_fmt, "dtype": dtype_name, "layout": layout,
                "source": SOURCE_DIR, "converted_from": str(src),
                "source_fingerprint": source_fingerprint(weight_files(out / SOURCE_DIR)),
                "model_type": spec.model_type, "moe_layers": list(spec.moe_layers), "num_experts": spec.num_experts,
                "matrices": metas}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    (out / MODEL_CARD).write_text(_conversion_card(src, out, spec, fmt, down_fmt, dtype_name, layout, placed))


def _place_source_weights(src: Path, dest: Path, progress: bool) -> str:
    """The source's weight files (and its shard index) in `dest`; how they got there ("linked" / "copied")."""
    dest.mkdir()
    files = weight_files(src)
    if src.is_dir() and (src / _INDEX).is_file() and not gguf_files(src):
        shutil.copy2(src / _INDEX, dest / _INDEX)
    card = src / MODEL_CARD if src.is_dir() else None
    if card is not None and card.is_file():
        shutil.copy2(card, dest / MODEL_CARD)  # the source's own card: its license and intended use
    return link_or_copy(files, dest, progress)


def _copy_side_files(src: Path, out: Path, config) -> None:
    """config.json, tokenizer and generation config travel with the cache; the weights are in source/ and the
    model card is written anew (the source's would describe weights this directory does not hold as such)."""
    if src.is_dir():
        for f in src.iterdir():
            if f.is_file() and f.suffix not in _WEIGHT_SUFFIXES and f.name not in (_INDEX, MODEL_CARD):
                shutil.copy2(f, out / f.name)
    if not (out / "config.json").is_file():  # a GGUF source: its metadata, as a config
        config.save_pretrained(out)
    _save_gguf_tokenizer(src, out)


def _save_gguf_tokenizer(src: Path, out: Path) -> None:
    """A GGUF keeps its vocabulary in its metadata; written as tokenizer files here, the output takes text
    (a load looks for tokenizer files in the model directory, and the GGUF now sits in source/)."""
    files = gguf_files(src)
    if not files or any((out / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return
    first = files[0]  # split files carry the vocabulary in the first one
    if "tokenizer.ggml.model" not in GGUFReader(str(first)).fields:
        return  # no vocabulary: prompts are token ids, as with the GGUF itself
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(first.parent), gguf_file=first.name, local_files_only=True)
    except (KeyError, ValueError, NotImplementedError) as err:  # a vocabulary transformers cannot convert
        warnings.warn(f"{first.name}: its tokenizer could not be converted ({err}); the converted model takes "
                      "prompts as token ids", stacklevel=3)
        return
    tokenizer.save_pretrained(out)


def _conversion_card(src: Path, out: Path, spec, fmt: str, down_fmt: str, dtype: str, layout: str,
                     placed: str) -> str:
    """The converted directory's README.md: what it holds, how it was made, how to load it."""
    own_card = (out / SOURCE_DIR / MODEL_CARD).is_file()
    formats = fmt if down_fmt == fmt else f"{fmt} (down projections {down_fmt})"
    flags = f"--cpu-expert-dtype {fmt}"
    if down_fmt != expert_down_format(fmt):
        flags += f" --cpu-expert-down-dtype {down_fmt}"
    lines = [
        f"# {src.name}, CPU-tier experts in {formats}",
        "",
        f"Written by `tiermoe convert {flags}` from `{src.name}`. Load this directory as the model "
        "(`--model` of `generate`, `chat --local`, `serve`, ...): the CPU tier memory-maps its converted experts "
        "instead of reading and quantising the source's.",
        "",
        "| | |",
        "|---|---|",
        f"| converted from | `{src}` (the path at conversion; no longer read) |",
        f"| model type | `{spec.model_type}`, {len(spec.moe_layers)} MoE layers x {spec.num_experts} routed experts, "
        f"top-{spec.top_k} |",
        f"| CPU-tier experts | {formats}, `{layout}` layout, computed in {dtype}: `layer-NNN.safetensors` |",
        f"| source weights | `{SOURCE_DIR}/`, {placed} from the source: non-expert weights, and the experts a GPU "
        "tier loads in their original format |",
        "| config, tokenizer | the source's |",
        "",
        "Outputs differ from the source's by the CPU-tier format's rounding only (none for bf16 experts of a bf16 "
        "model); GPU-tier experts are the source's own.",
    ]
    if own_card:
        lines += ["", f"The source's own model card (license, intended use): `{SOURCE_DIR}/{MODEL_CARD}`."]
    return "\n".join(lines) + "\n"
