"""Load a Hugging Face MoE checkpoint into two tiers without materialising the whole model first.

1. read config.json and detect the architecture;
2. build the transformers skeleton with meta parameters;
3. swap every MoE block for a HybridMoE (router and shared experts kept, fused experts dropped);
4. read non-expert weights onto `gpu_device`, with the checkpoint's own names;
5. read each routed expert once, straight into its tier: GPU-tier experts pass through a host buffer of one
   expert; CPU-tier experts are read into their final host tensors (pinned when CUDA is present).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from tiermoe.arch import detect, load_config
from tiermoe.errors import TiermoeError
from tiermoe.experts.ffn import ExpertActivation
from tiermoe.config import CPUConfig
from tiermoe.experts.registry import make_cpu_tier
from tiermoe.experts.tiers import CPUWorker, ExpertSet
from tiermoe.layers.hybrid_moe import HybridMoE
from tiermoe.model.checkpoint import Checkpoint
from tiermoe.model.expert_source import ExpertSource, find_expert_source, read_expert
from tiermoe.model.hybrid_model import HybridModel
from tiermoe.model.skeleton import build_skeleton, decoder_layers, moe_block_attr
from tiermoe.placement.mask import validate_mask

log = logging.getLogger(__name__)
LAYERS_PREFIX = "model.layers"
# Checkpoints of models that wrap the language model (configs with a nested text_config) prefix its names.
_WRAPPER_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


def load_hybrid_model(model_dir: str | Path, mask=None, *, gpu_device: str | torch.device = "cpu",
                      dtype: torch.dtype | None = None, cpu: CPUConfig = CPUConfig(),
                      progress: bool = True) -> HybridModel:
    """Load `model_dir` with routed experts placed by `mask` ([L, E] bool, True = GPU tier; None = all CPU).

    `gpu_device` is the main device (non-expert weights and GPU-tier experts): "cuda:0" in production, "cpu"
    to run every path without CUDA. `dtype` defaults to the checkpoint's dtype. `cpu` chooses the CPU tier's
    backend, expert format and threads.
    """
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    spec = detect(config)
    mask_LE = validate_mask(mask, spec)
    gpu_device = torch.device(gpu_device)
    dtype = dtype or spec.dtype
    pin = torch.cuda.is_available()

    with Checkpoint(model_dir) as ckpt:
        sources = {layer: find_expert_source(ckpt, spec, LAYERS_PREFIX, layer) for layer in spec.moe_layers}
        model = build_skeleton(config, dtype)
        worker = CPUWorker()
        act = ExpertActivation.from_config(spec.activation, config)
        blocks = _inject_hybrid_blocks(model, spec, gpu_device, act, worker, pin, cpu, dtype)
        total = _non_expert_bytes(model) + spec.total_routed_experts * spec.bytes_per_expert(dtype)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {model_dir.name}", disable=not progress) as bar:
            _load_non_experts(model, ckpt, spec, gpu_device, bar)
            _load_experts(blocks, sources, ckpt, spec, mask_LE, dtype, pin, bar)
    _tie_and_check(model, config)
    return HybridModel(model, config, spec, blocks, gpu_device, worker, model_dir, dtype)


def _inject_hybrid_blocks(model: nn.Module, spec, gpu_device, act, worker, pin, cpu: CPUConfig,
                          dtype: torch.dtype) -> dict[int, HybridMoE]:
    blocks = {}
    for i, layer in enumerate(decoder_layers(model)):
        attr = moe_block_attr(layer)
        if (attr is not None) != spec.is_moe_layer(i):
            raise RuntimeError(f"layer {i}: transformers built {'a MoE' if attr else 'a dense'} block, "
                               f"but the config rule says otherwise for {spec.model_type}")
        if attr is None:
            continue
        gpu_tier = ExpertSet(gpu_device, act)
        cpu_tier = make_cpu_tier(cpu, worker, act, pin, dtype)
        blocks[i] = HybridMoE(getattr(layer, attr), spec, i, gpu_tier, cpu_tier)
        setattr(layer, attr, blocks[i])
    return blocks


def _meta_tensors(model: nn.Module):
    """(qualified name, owning module, leaf name, tensor, is_param) for every tensor still on the meta device."""
    seen = set()
    for mod_name, module in model.named_modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for leaf, t in store.items():
                if t is None or not t.is_meta or id(t) in seen:
                    continue
                seen.add(id(t))
                yield (f"{mod_name}.{leaf}" if mod_name else leaf), module, leaf, t, is_param


def _non_expert_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for _, _, _, t, _ in _meta_tensors(model))


def _disk_name(name: str, spec, ckpt: Checkpoint) -> str | None:
    candidates = [name]
    if spec.disk.block != "mlp":
        candidates.append(name.replace(".mlp.", f".{spec.disk.block}."))
    for base in list(candidates):
        if base.startswith("model."):
            candidates += [p + base.removeprefix("model.") for p in _WRAPPER_PREFIXES]
    return next((c for c in candidates if c in ckpt), None)


def _load_non_experts(model: nn.Module, ckpt: Checkpoint, spec, gpu_device, bar) -> None:
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, module, leaf, meta, is_param in list(_meta_tensors(model)):
        disk = _disk_name(name, spec, ckpt)
        if disk is None:
            if tied and name == "lm_head.weight":
                continue  # tied to the embeddings below
            raise TiermoeError(f"checkpoint has no tensor '{name}', which this {spec.model_type} model needs")
        value = ckpt.read(disk, torch.empty(meta.shape, dtype=meta.dtype)).to(gpu_device)
        if is_param:
            module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[leaf] = value
        bar.update(value.numel() * value.element_size())


def _load_experts(blocks, sources: dict[int, ExpertSource], ckpt, spec, mask_LE, dtype, pin, bar) -> None:
    for layer, block in blocks.items():
        for e in range(spec.num_experts):
            on_gpu = bool(mask_LE[layer, e])
            tier = block.gpu_tier if on_gpu else block.cpu_tier
            host = read_expert(ckpt, sources[layer], e, spec, dtype, pin=pin and not on_gpu)
            # On a CPU gpu_device this is the same tensor; on CUDA the host buffer is freed right after.
            tier.add(e, host if tier.device.type == "cpu" else host.to(tier.device))
            block.set_on_gpu(e, on_gpu)
            bar.update(host.nbytes)


def _tie_and_check(model: nn.Module, config) -> None:
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [name for name, *_ in _meta_tensors(model)]
    if left:
        raise TiermoeError(f"checkpoint is missing tensors: {', '.join(left[:5])}")
