"""KTransformers-style device maps as a placement: `{(layer, expert): "cuda"|"cpu"}` (what
tiermoe.compat.build_device_map writes) or the Hugging Face `device_map` KTransformers' fine-tuning loader builds
(`{"model.layers.3.mlp.experts.5": "cuda:0", "model.embed_tokens": "cuda:0", ...}`), turned into an assignment.
"""

from __future__ import annotations

import re

import torch

from tiermoe.arch.spec import ArchSpec
from tiermoe.errors import TiermoeError

# An expert module's name in a transformers module tree: "...layers.<layer>.<block>.experts.<expert>".
_EXPERT_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.+\.)?experts\.(\d+)$")
_GPU_DEVICE = re.compile(r"cuda(?::(\d+))?$")


def assignment_from_device_map(device_map: dict, spec: ArchSpec, num_gpus: int) -> torch.Tensor:
    """int64 [L, E] (-1 CPU tier, r GPU rank r) from a device map. Experts it leaves out stay on the CPU tier;
    module names that are not routed experts (embeddings, whole layers) are ignored, as are routed-expert names
    in dense layers (modules a Hugging Face model does not have). With one GPU rank, any single GPU is rank 0."""
    entries = {}  # (layer, expert) -> GPU index, or -1 for the CPU tier
    from_names = set()
    for key, device in device_map.items():
        position = _position(key)
        if position is None:
            continue
        if isinstance(key, str):
            from_names.add(position)
        entries[position] = _device_index(device, position)
    if not entries:
        raise TiermoeError("the device map names no routed expert: give {(layer, expert): 'cuda'|'cpu'} or "
                           "'model.layers.<layer>.mlp.experts.<expert>' keys")
    moe_layers = set(spec.moe_layers)
    assignment = torch.full((spec.num_layers, spec.num_experts), -1, dtype=torch.int64)
    gpus = sorted({index for index in entries.values() if index >= 0})
    for (layer, expert), index in entries.items():
        if not (0 <= layer < spec.num_layers and 0 <= expert < spec.num_experts):
            raise TiermoeError(f"device map entry (layer {layer}, expert {expert}) is outside the model "
                               f"({spec.num_layers} layers x {spec.num_experts} experts)")
        if layer not in moe_layers:
            # KTransformers marks a dense layer's whole row True (build_device_map then lists it on the GPU): no
            # expert to place. Only part of a dense row on a GPU is a mistake worth a word.
            whole_row = all(entries.get((layer, e), -1) >= 0 for e in range(spec.num_experts))
            if index >= 0 and (layer, expert) not in from_names and not whole_row:
                raise TiermoeError(f"device map puts expert {expert} of layer {layer} on a GPU, but layer {layer} is "
                                   f"dense (no routed experts; MoE layers: {sorted(moe_layers)})")
            continue
        if index >= 0:
            assignment[layer, expert] = 0 if num_gpus == 1 and len(gpus) == 1 else index
    if assignment.numel() and int(assignment.max()) >= num_gpus:
        raise TiermoeError(f"device map uses cuda:{int(assignment.max())} but {num_gpus} GPU rank(s) run "
                           f"(ranks cuda:0..cuda:{num_gpus - 1})")
    return assignment


def _position(key) -> tuple[int, int] | None:
    """(layer, expert) of a key, None for a module name that is no routed expert."""
    if isinstance(key, str):
        match = _EXPERT_NAME.search(key)
        return (int(match[1]), int(match[2])) if match else None
    if (isinstance(key, tuple) and len(key) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in key)):
        return key
    raise TiermoeError(f"device map key {key!r} is neither (layer, expert) nor a module name")


def _device_index(device, position: tuple[int, int]) -> int:
    """-1 for the CPU, the GPU index otherwise ("cuda" is GPU 0; a bare integer is a GPU index, as in
    Hugging Face device maps)."""
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    if isinstance(device, (str, torch.device)):
        name = str(device)
        if name == "cpu":
            return -1
        match = _GPU_DEVICE.match(name)
        if match:
            return int(match[1] or 0)
    raise TiermoeError(f"device map entry {position} has unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'")
