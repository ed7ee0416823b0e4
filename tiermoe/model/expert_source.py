"""Where one layer's routed experts are in a checkpoint, and reading one of them into tiermoe's layout.

Three on-disk layouts exist (see ExpertDiskLayout): per-expert 2-D keys (most releases, and what
`save_pretrained` writes), transformers' fused 3-D keys (`save_original_format=False`), and GPT-OSS's fused,
transposed, interleaved keys with biases. Each expert is read once; the per-expert and transformers-fused
layouts are read straight into the destination tensors, GPT-OSS through one expert-sized buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    proj_names: tuple[str, str, str]

    def per_expert_keys(self, expert: int) -> list[str]:
        return [f"{self.prefix}.{expert}.{p}.weight" for p in self.proj_names]

    def fused_keys(self) -> list[str]:
        names = ["gate_up_proj", "down_proj"]
        if self.fused == "gpt_oss":
            names += ["gate_up_proj_bias", "down_proj_bias"]
        return [f"{self.prefix}.{n}" for n in names]


def find_expert_source(ckpt: Checkpoint, spec: ArchSpec, layers_prefix: str, layer: int) -> ExpertSource:
    """Locate layer `layer`'s experts and check that every one of them is present, before anything is read."""
    for block in dict.fromkeys((spec.disk.block, "mlp")):
        prefix = f"{layers_prefix}.{layer}.{block}.experts"
        per_expert = ExpertSource(layer, prefix, None, spec.disk.proj_names)
        if per_expert.per_expert_keys(0)[0] in ckpt:
            for e in range(spec.num_experts):
                for key in per_expert.per_expert_keys(e):
                    if key not in ckpt:
                        raise TiermoeError(f"checkpoint is missing expert {e} of layer {layer}: no tensor '{key}'")
            return per_expert
        fused = ExpertSource(layer, prefix, spec.disk.fused_kind, spec.disk.proj_names)
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
    raise TiermoeError(
        f"checkpoint is missing the experts of layer {layer}: no '{layers_prefix}.{layer}.{spec.disk.block}.experts.0."
        f"{spec.disk.proj_names[0]}.weight' nor fused '...experts.gate_up_proj'"
    )


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
    h, i = spec.hidden_size, spec.expert_intermediate_size
    gate_up = torch.empty((2 * i, h), dtype=dtype)
    down = torch.empty((h, i), dtype=dtype)
    if src.fused is None:
        gate_key, up_key, down_key = src.per_expert_keys(expert)
        ckpt.read(gate_key, gate_up[:i])
        ckpt.read(up_key, gate_up[i:])
        ckpt.read(down_key, down)
        return ExpertWeights(gate_up, down)
    if src.fused == "transformers":
        gate_up_key, down_key = src.fused_keys()
        ckpt.read(gate_up_key, gate_up, index=expert)
        ckpt.read(down_key, down, index=expert)
        return ExpertWeights(gate_up, down)
    # GPT-OSS: gate_up [H, 2I] with gate = even columns, up = odd; down [I, H]; x @ W + b on disk.
    gate_up_key, down_key, gate_up_bias_key, down_bias_key = src.fused_keys()
    w_H2I = ckpt.read(gate_up_key, torch.empty(h, 2 * i, dtype=dtype), index=expert)
    gate_up[:i].copy_(w_H2I[:, 0::2].T)
    gate_up[i:].copy_(w_H2I[:, 1::2].T)
    del w_H2I
    w_IH = ckpt.read(down_key, torch.empty(i, h, dtype=dtype), index=expert)
    down.copy_(w_IH.T)
    del w_IH
    b_2I = ckpt.read(gate_up_bias_key, torch.empty(2 * i, dtype=dtype), index=expert)
    gate_up_bias = torch.empty((2 * i,), dtype=dtype)
    gate_up_bias[:i].copy_(b_2I[0::2])
    gate_up_bias[i:].copy_(b_2I[1::2])
    down_bias = ckpt.read(down_bias_key, torch.empty((h,), dtype=dtype), index=expert)
    return ExpertWeights(gate_up, down, gate_up_bias, down_bias)
