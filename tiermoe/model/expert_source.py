"""Where one layer's routed experts are in a checkpoint, and reading one of them into tiermoe's layout.

Three on-disk layouts exist (see ExpertDiskLayout): per-expert 2-D keys (most releases, and what
`save_pretrained` writes), transformers' fused 3-D keys (`save_original_format=False`), and GPT-OSS's fused,
transposed, interleaved keys with biases. A family found by discovery has its fused layout as its experts module
has it (transposed, interleaved, with biases, or without a gate: `up_proj` alone). Each expert is read once; the
per-expert and plain fused layouts are read straight into the destination tensors, the others through one
expert-sized buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tiermoe.arch.disk_names import on_disk
from tiermoe.arch.spec import ArchSpec
from tiermoe.checkpoint.fp8 import is_block_fp8, scale_name
from tiermoe.checkpoint.safetensors import Checkpoint
from tiermoe.errors import TiermoeError
from tiermoe.experts.fp8_blocks import scale_shape
from tiermoe.experts.fp8_tier import FP8ExpertWeights
from tiermoe.experts.weights import ExpertWeights

LAYERS_PREFIX = "model.layers"  # where transformers' decoder layers (and the checkpoint's names) start


@dataclass(frozen=True)
class ExpertSource:
    """How to read the experts of one layer: `fused` (None for per-expert keys) and the key prefix."""

    layer: int
    prefix: str  # e.g. "model.layers.3.mlp.experts"
    fused: str | None  # None | "transformers" | "gpt_oss"
    proj_names: tuple[str, str, str]  # gate ("" for experts without a gate), up, down
    transposed: bool = False  # fused: [E, H, 2I] / [E, I, H]
    interleaved: bool = False  # fused: gate and up columns alternate
    bias: bool = False  # fused: gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]
    gated: bool = True
    names: tuple[str, ...] = ()  # fused: the checkpoint's names of fused_keys, where they differ

    def per_expert_keys(self, expert: int) -> list[str]:
        """Keys of gate (when gated), up and down."""
        return [f"{self.prefix}.{expert}.{p}.weight" for p in self.proj_names if p]

    def fused_keys(self) -> list[str]:
        """gate_up (up_proj without a gate), down, then their biases where the experts have them: as the
        checkpoint names them (`names`, a released checkpoint's renamed tensors), else as the module does."""
        if self.names:
            return list(self.names)
        first = "gate_up_proj" if self.gated else "up_proj"
        names = [first, "down_proj"] + ([f"{first}_bias", "down_proj_bias"] if self.bias else [])
        return [f"{self.prefix}.{n}" for n in names]

    @property
    def direct(self) -> bool:
        """Whether each expert reads straight into tiermoe's layout (no transpose, interleave or bias)."""
        return self.fused is None or (self.fused == "transformers" and not (self.transposed or self.interleaved
                                                                            or self.bias))


def find_expert_source(ckpt: Checkpoint, spec: ArchSpec, layers_prefix: str, layer: int) -> ExpertSource:
    """Locate layer `layer`'s experts and check that every one of them is present, before anything is read."""
    disk = spec.disk
    gpt_oss = disk.fused_kind == "gpt_oss"
    blocks = [".".join(p for p in (layers_prefix, str(layer), block, "experts") if p)
              for block in dict.fromkeys((disk.block, spec.moe_path, "mlp"))]
    for prefix in dict.fromkeys(name for block in blocks for name in on_disk(block, disk.renames)):
        per_expert = ExpertSource(layer, prefix, None, disk.proj_names, gated=spec.gated)
        if per_expert.per_expert_keys(0)[0] in ckpt:
            for e in range(spec.num_experts):
                for key in per_expert.per_expert_keys(e):
                    if key not in ckpt:
                        raise TiermoeError(f"checkpoint is missing expert {e} of layer {layer}: no tensor '{key}'")
            return per_expert
        fused = ExpertSource(layer, prefix, disk.fused_kind, disk.proj_names, disk.transposed or gpt_oss,
                             disk.interleaved or gpt_oss, spec.expert_bias, spec.gated)
        fused = replace(fused, names=tuple(_stored_name(ckpt, key, disk.renames) for key in fused.fused_keys()))
        if fused.fused_keys()[0] in ckpt:
            for key in fused.fused_keys():
                if key not in ckpt:
                    raise TiermoeError(f"checkpoint is missing tensor '{key}' (experts of layer {layer})")
                rows = ckpt.shape(key)[0]
                if rows != spec.num_experts:
                    raise TiermoeError(
                        f"checkpoint is missing experts of layer {layer}: '{key}' holds {rows}, "
                        f"config says {spec.num_experts}"
                    )
            return fused
        if f"{prefix}.gate_up_proj_blocks" in ckpt:
            raise TiermoeError(f"layer {layer} stores MXFP4 experts ('{prefix}.gate_up_proj_blocks'), "
                               "which tiermoe does not read yet; expected bf16/fp32 experts")
    first = next(p for p in disk.proj_names if p)
    raise TiermoeError(
        f"checkpoint is missing the experts of layer {layer}: no '{layers_prefix}.{layer}.{disk.block}.experts.0."
        f"{first}.weight' nor fused '...experts.{'gate_up_proj' if spec.gated else 'up_proj'}'"
    )


def _stored_name(ckpt: Checkpoint, key: str, renames: tuple[tuple[str, str], ...]) -> str:
    """`key`, or the name a released checkpoint stores it under (tiermoe.arch.disk_names), whichever it holds."""
    return next((name for name in on_disk(key, renames) if name in ckpt), key)


def keeps_fp8(ckpt: Checkpoint, src: ExpertSource) -> bool:
    """Whether this layer's experts can be held as the checkpoint's own FP8 codes and scales: per-expert keys
    stored block-FP8 (the released layout). Fused FP8 layouts are read dequantised instead."""
    return src.fused is None and all(is_block_fp8(ckpt, key) for key in src.per_expert_keys(0))


def read_fp8_expert(ckpt: Checkpoint, src: ExpertSource, expert: int, spec: ArchSpec) -> FP8ExpertWeights:
    """Expert `expert` of a `keeps_fp8` source as host tensors: its codes and scales, as stored."""
    h, i = spec.hidden_size, spec.expert_intermediate_size
    parts = []
    for key, shape in zip(src.per_expert_keys(expert), ((i, h), (i, h), (h, i))):
        for name, want in ((key, shape), (scale_name(key), scale_shape(shape, ckpt.fp8_block))):
            if tuple(ckpt.shape(name)) != want:
                raise TiermoeError(f"{ckpt.model_dir}: tensor {name} has shape {list(ckpt.shape(name))}, expected "
                                   f"{list(want)}")
            parts.append(ckpt.read(name))
    return FP8ExpertWeights(*parts, ckpt.fp8_block)


def read_expert(ckpt: Checkpoint, src: ExpertSource, expert: int, spec: ArchSpec,
                dtype: torch.dtype) -> ExpertWeights:
    """Expert `expert` of `src.layer` as new host tensors in `dtype`, canonical layout (never pinned one by one:
    the loader reads page-locked experts into slots of a slab, tiermoe.experts.host_slab)."""
    h, i, rows = spec.hidden_size, spec.expert_intermediate_size, spec.gate_up_rows
    gate_up = torch.empty((rows, h), dtype=dtype)
    down = torch.empty((h, i), dtype=dtype)
    if src.fused is None:
        *first, down_key = src.per_expert_keys(expert)
        for key, part in zip(first, gate_up.split(i)):
            ckpt.read(key, part)
        ckpt.read(down_key, down)
        return ExpertWeights(gate_up, down)
    gate_up_key, down_key, *bias_keys = src.fused_keys()
    if src.direct:
        ckpt.read(gate_up_key, gate_up, index=expert)
        ckpt.read(down_key, down, index=expert)
        return ExpertWeights(gate_up, down)
    # transposed (x @ W: gate_up [H, 2I], down [I, H]) and / or gate and up interleaved (gate = even columns)
    if src.transposed:
        gate_up.copy_(_gate_first(ckpt.read(gate_up_key, torch.empty(h, rows, dtype=dtype), index=expert).T,
                                  src.interleaved))
        down.copy_(ckpt.read(down_key, torch.empty(i, h, dtype=dtype), index=expert).T)
    else:
        gate_up.copy_(_gate_first(ckpt.read(gate_up_key, torch.empty(rows, h, dtype=dtype), index=expert),
                                  src.interleaved))
        ckpt.read(down_key, down, index=expert)
    if not bias_keys:
        return ExpertWeights(gate_up, down)
    gate_up_bias = _gate_first(ckpt.read(bias_keys[0], torch.empty(rows, dtype=dtype), index=expert),
                               src.interleaved).contiguous()
    down_bias = ckpt.read(bias_keys[1], torch.empty((h,), dtype=dtype), index=expert)
    return ExpertWeights(gate_up, down, gate_up_bias, down_bias)


def _gate_first(rows_2I: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[2I, ...] with gate and up rows alternating -> gate rows, then up rows (a view where nothing moves)."""
    if not interleaved:
        return rows_2I
    return torch.cat([rows_2I[0::2], rows_2I[1::2]])
