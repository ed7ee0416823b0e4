"""`tiermoe convert`: write every routed expert in a CPU-tier format once, so later loads map it instead.

The experts stream from the source (safetensors in any dtype, FP8 block-quantised, or GGUF) one at a time:
read (dequantised to the compute dtype), quantised to `fmt` (tiermoe.experts.quant, the CPU tier's own code),
laid out for the native kernels when this machine has them, and written, so memory stays about one expert
whatever the model size. Everything is written into a temporary directory beside `out`, renamed to `out` only
once complete: a failed or interrupted conversion (Ctrl-C included) removes it and leaves `out` as it was, so the
rerun starts clean.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tiermoe.arch import detect, load_config
from tiermoe.checkpoint.expert_cache import (
    MANIFEST,
    VERSION,
    StreamingLayerWriter,
    expert_tensors,
    layer_file,
    matrix_meta,
    source_fingerprint,
)
from tiermoe.checkpoint.fp8 import fp8_block_size
from tiermoe.errors import TiermoeError
from tiermoe.experts.kernels import load_kernels
from tiermoe.experts.quant import FORMATS, expert_in_layout, kernels_take_shape, quantize
from tiermoe.model.expert_source import LAYERS_PREFIX, find_expert_source, read_expert
from tiermoe.model.gguf_checkpoint import open_checkpoint, weight_files


def kernel_layout(fmt: str, spec) -> bool:
    """Whether the native CPU tier of this machine computes these experts from the "blocked" layout (the rule
    NativeCPUExperts applies: kernels available, SiLU-GLU experts, and bf16 only for shapes in multiples of 32)."""

    if spec.activation != "silu_glu" or load_kernels() is None:
        return False
    return kernels_take_shape(fmt, spec.hidden_size, spec.expert_intermediate_size)


def _copy_side_files(src: Path, out: Path, config) -> None:
    """config.json, tokenizer and generation config travel with the cache (weights stay in the source)."""
    if src.is_dir():
        for f in src.iterdir():
            if f.is_file() and f.suffix not in (".safetensors", ".gguf", ".bin", ".pt") and \
                    f.name != "model.safetensors.index.json":
                shutil.copy2(f, out / f.name)
    if not (out / "config.json").is_file():  # a GGUF source: its metadata, as a config
        config.save_pretrained(out)


def convert_cpu_experts(model: str | Path, fmt: str, out: str | Path, dtype: torch.dtype | None = None,
                        progress: bool = True) -> Path:
    """Write all routed experts of `model` in CPU format `fmt` ("bf16" | "int8" | "int4") to `out`."""
    src, out = Path(model).resolve(), Path(out)
    if fmt not in FORMATS:
        raise TiermoeError(f"--cpu-expert-dtype '{fmt}' is unknown; choose one of: {', '.join(FORMATS)}")
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
        _write_cache(src, fmt, partial, dtype, progress)
        os.replace(partial, out)  # atomic; replaces `out` only when it is an empty directory
    except BaseException:  # a failure or Ctrl-C: nothing half-written stays behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _write_cache(src: Path, fmt: str, out: Path, dtype: torch.dtype | None, progress: bool) -> None:
    """The whole cache of `src` written into the (empty) directory `out`."""
    config = load_config(src)
    spec = detect(config)
    dtype = dtype or spec.dtype
    layout = "blocked" if kernel_layout(fmt, spec) else "rows"
    files = weight_files(src)
    metas = None
    total = spec.total_routed_experts
    with open_checkpoint(src, config, fp8_block_size(config)) as ckpt, \
            tqdm(total=total, unit="expert", desc=f"converting {src.name} to {fmt}", disable=not progress) as bar:
        for layer in spec.moe_layers:
            source = find_expert_source(ckpt, spec, LAYERS_PREFIX, layer)
            writer = None
            for e in range(spec.num_experts):
                w = read_expert(ckpt, source, e, spec, dtype)
                gate_up, down = expert_in_layout(quantize(w.gate_up, fmt), quantize(w.down, fmt), layout)
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
    manifest = {"version": VERSION, "format": fmt, "dtype": str(dtype).removeprefix("torch."),
                "layout": layout, "source": str(src),
                "source_fingerprint": source_fingerprint(files), "model_type": spec.model_type,
                "moe_layers": list(spec.moe_layers), "num_experts": spec.num_experts, "matrices": metas}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
