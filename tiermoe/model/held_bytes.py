"""Bytes a checkpoint's tensors take once loaded, and the names the loader finds them under: from headers only.

The loader, `tiermoe fit` and the --gpu-memory-gb planner all count with these functions, so the three agree on
what a load holds (GGUF tensors in the compute dtype, block-FP8 ones as stored with their scales).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import NamedTuple

import torch

from tiermoe.arch import ArchSpec, text_config
from tiermoe.arch.disk_names import on_disk
from tiermoe.checkpoint.fp8 import fp8_block_size, is_block_fp8, scale_name
from tiermoe.checkpoint.safetensors import Checkpoint
from tiermoe.experts.fp8_blocks import dequant_bytes
from tiermoe.experts.fp8_tier import fp8_expert_bytes
from tiermoe.model.expert_source import LAYERS_PREFIX, find_expert_source, keeps_fp8
from tiermoe.model.gguf_checkpoint import open_checkpoint
from tiermoe.model.skeleton import build_skeleton

# A routed experts module's fused weights (the tiers hold them); anything else under `.experts.` (Ergo's per-expert
# norm) is a non-expert weight on the main device.
ROUTED_EXPERT_NAME = re.compile(r"\.experts\.(gate_up_proj|up_proj|down_proj)(_bias)?$")
# Checkpoints of models that wrap the language model (configs with a nested text_config) prefix its names.
_WRAPPER_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


def held_nbytes(name: str, t: torch.Tensor, spec, ckpt: Checkpoint) -> int:
    """Bytes model tensor `name` (`t`: its meta tensor, in the dtype the skeleton gives it) takes once loaded:
    block-FP8 tensors as stored with their scales, every other tensor in `t`'s dtype."""
    disk = disk_name(name, spec, ckpt)
    if is_block_fp8(ckpt, disk):
        return ckpt.entries[disk].nbytes + ckpt.entries[scale_name(disk)].nbytes
    return t.numel() * t.element_size()


class HeldBytes(NamedTuple):
    """What a load holds, and the FP8 transients it adds while computing (bytes)."""

    non_expert: int
    gpu_expert: int
    fp8_matrix: int  # the largest FP8-stored non-expert weight, dequantised (FP8Linear, per call)
    fp8_expert: int  # one FP8 GPU-tier expert, dequantised (FP8ExpertSet, one expert at a time); 0 if not FP8


def fp8_expert_dequant_bytes(spec, block: tuple[int, int], dtype: torch.dtype) -> int:
    """One FP8 expert dequantised in the forward: gate_up [2I, H] (gate and up dequantised into it one after the
    other) and down [H, I]."""
    h, i = spec.hidden_size, spec.expert_intermediate_size
    gate_up = 2 * i * h * dtype.itemsize + dequant_bytes((i, h), block, dtype) - i * h * dtype.itemsize
    return gate_up + dequant_bytes((h, i), block, dtype)


def gpu_expert_bytes(ckpt: Checkpoint, spec, dtype: torch.dtype) -> int:
    """Bytes one GPU-tier expert takes once loaded: as stored (codes and block scales) where the checkpoint keeps
    its experts block-FP8 (FP8ExpertSet), else in `dtype`."""
    src = find_expert_source(ckpt, spec, LAYERS_PREFIX, spec.moe_layers[0])
    return fp8_expert_bytes(spec, ckpt.fp8_block) if keeps_fp8(ckpt, src) else spec.bytes_per_expert(dtype)


def disk_name(name: str, spec, ckpt: Checkpoint) -> str | None:
    """The checkpoint's name for model tensor `name` (the block renamed for Mixtral, a released checkpoint's names
    for a discovered family, wrapper prefixes tried)."""
    candidates = [name] + on_disk(name, spec.disk.renames)[1:]  # a discovered family's released names
    if spec.disk.block != "mlp" and not spec.disk.renames:
        candidates.append(name.replace(".mlp.", f".{spec.disk.block}."))
    for base in list(candidates):
        if base.startswith("model."):
            candidates += [p + base.removeprefix("model.") for p in _WRAPPER_PREFIXES]
    return next((c for c in candidates if c in ckpt), None)


def bytes_from_headers(model_dir: Path, dtype: torch.dtype, cfg, spec: ArchSpec) -> tuple[int, int]:
    """(non-expert bytes, bytes of one GPU-tier expert): `held_from_headers` without the FP8 transients."""
    held = held_from_headers(model_dir, dtype, cfg, spec)
    return held.non_expert, held.gpu_expert


def held_from_headers(model_dir: Path, dtype: torch.dtype, cfg, spec: ArchSpec) -> HeldBytes:
    """What a load holds, exactly as the loader allocates it, from one read of the headers. Non-expert: each
    tensor the model needs, in the dtype the skeleton gives it (`dtype`, or fp32 where transformers keeps routers
    in fp32), except Linear weights the checkpoint stores FP8 with block scales, which stay as stored; names are
    looked up as the loader does. GPU expert: `gpu_expert_bytes`. FP8 transients: what dequantising the largest
    FP8 weight and one FP8 GPU-tier expert holds (tiermoe.experts.fp8_blocks.dequant_bytes)."""
    tied = getattr(text_config(cfg), "tie_word_embeddings", False)
    with open_checkpoint(model_dir, cfg, fp8_block_size(cfg)) as ckpt:
        non_expert = fp8_matrix = 0
        for name, t in build_skeleton(copy.deepcopy(cfg), dtype).state_dict().items():  # copy: it sets cfg.dtype
            if ROUTED_EXPERT_NAME.search(name) or (tied and name == "lm_head.weight"):
                continue
            non_expert += held_nbytes(name, t, spec, ckpt)
            disk = disk_name(name, spec, ckpt)
            if is_block_fp8(ckpt, disk) and t.dim() == 2:
                fp8_matrix = max(fp8_matrix, dequant_bytes(tuple(t.shape), ckpt.fp8_block, dtype))
        experts_fp8 = keeps_fp8(ckpt, find_expert_source(ckpt, spec, LAYERS_PREFIX, spec.moe_layers[0]))
        fp8_expert = fp8_expert_dequant_bytes(spec, ckpt.fp8_block, dtype) if experts_fp8 else 0
        return HeldBytes(non_expert, gpu_expert_bytes(ckpt, spec, dtype), fp8_matrix, fp8_expert)
