"""Load a Hugging Face MoE checkpoint into two tiers without materialising the whole model first.

1. read config.json and detect the architecture;
2. build the transformers skeleton with meta parameters;
3. swap every MoE block for a HybridMoE (router and shared experts kept, fused experts dropped), and every
   MLA attention (DeepSeek V2/V3) for an MLAAttention that caches the latent (tiermoe.layers.mla_attention);
4. read non-expert weights onto `gpu_device`, with the checkpoint's own names, and move every buffer there too;
5. read each routed expert once, straight into its tier: GPU-tier experts pass through a host buffer of one
   expert; CPU-tier experts are read into their final host tensors: when the GPU tier is on CUDA and the CPU
   tier computes from the tensors it is given, views of one page-locked slab per layer
   (tiermoe.experts.host_slab), else plain memory.

FP8 block-quantised checkpoints (tiermoe.checkpoint.fp8): Linear weights stored FP8 become FP8Linear modules on the
main device (about 1 byte per parameter); GPU-tier experts keep their codes and scales too (FP8ExpertSet, read
as stored); CPU-tier experts are dequantised one at a time as they stream in and take the CPU tier's format
(--cpu-expert-dtype), so host memory peaks at the CPU tier plus one expert.
GGUF files read the same way through GGUFCheckpoint. A `tiermoe convert` directory (tiermoe.checkpoint.expert_cache)
takes its CPU-tier experts memory-mapped from the cache and everything else from the source it names.

The placement is a PlacementPlan, whose assignment [L, E] says where each expert goes (-1 CPU tier, r GPU rank
r); one process is a plan with one GPU rank. With several ranks (`share`, see tiermoe.distributed) this rank
reads only its own GPU experts, and only the rank that holds the CPU tier reads the CPU experts, into host memory
the share provides (shared memory, one copy per host whatever the number of ranks).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from tiermoe.arch import detect, load_config
from tiermoe.arch.transformers_version import check_transformers_for
from tiermoe.arch.tuned import TUNED
from tiermoe.checkpoint.expert_cache import ExpertCache, find_cache
from tiermoe.checkpoint.fp8 import FP8Linear, fp8_block_size, is_block_fp8, scale_name
from tiermoe.checkpoint.safetensors import Checkpoint
from tiermoe.config import CPUConfig
from tiermoe.errors import TiermoeError
from tiermoe.experts.ffn import ExpertActivation
from tiermoe.experts.fp8_tier import FP8ExpertSet, fp8_expert_bytes
from tiermoe.experts.host_slab import HostSlab, expert_shapes, pins_host_memory
from tiermoe.experts.kernels import ACTIVATION_CODES, load_kernels
from tiermoe.experts.native import model_team
from tiermoe.experts.python_arenas import keep_frame_chunks
from tiermoe.experts.registry import make_cpu_tier
from tiermoe.experts.slot_pool import ExpertSlotPool, fp8_kernel
from tiermoe.experts.slotted_fp8_tier import SlottedFP8ExpertSet
from tiermoe.experts.slotted_tier import SlottedExpertSet
from tiermoe.experts.tiers import CPUWorker, ExpertSet
from tiermoe.experts.weights import ExpertWeights
from tiermoe.layers.decode_attention import (
    DecodeAttention,
    check_attention_backend,
    decode_attention_for,
)
from tiermoe.layers.deferred_experts import DeferredExperts
from tiermoe.layers.fused_attention import fuse_decode_attention
from tiermoe.layers.fused_decode_layer import fuse_decode_layers
from tiermoe.layers.hybrid_moe import HybridMoE
from tiermoe.layers.lm_head import use_rows_lm_head
from tiermoe.layers.mla_attention import (
    MLAAttention,
    group_kv_b_rows_of,
    replace_mla_attention,
)
from tiermoe.layers.mla_decode_call import attach_mla_decode
from tiermoe.model.cpu_only import cpu_only_defaults, torch_threads_beside
from tiermoe.model.expert_source import (
    LAYERS_PREFIX,
    ExpertSource,
    find_expert_source,
    keeps_fp8,
    read_expert,
    read_fp8_expert,
)
from tiermoe.model.fused_layers import fuse_layer_ops
from tiermoe.model.gguf_checkpoint import open_checkpoint, weight_files
from tiermoe.model.heap_trim import return_freed_heap
from tiermoe.model.held_bytes import disk_name, held_nbytes
from tiermoe.model.hybrid_experts import (
    HybridEveryExpert,
    HybridExperts,
    experts_around,
)
from tiermoe.model.hybrid_model import HybridModel
from tiermoe.model.lora_merge import MergedLoRA
from tiermoe.model.non_expert_quant import (
    check_head_dtype,
    check_non_expert_dtype,
    pack_routers,
    quantize_non_experts,
)
from tiermoe.model.plan_source import resolve_plan
from tiermoe.model.skeleton import (
    build_skeleton,
    decoder_layers,
    meta_tensors,
    moe_block,
    move_buffers,
)

log = logging.getLogger(__name__)


class RankShare(Protocol):
    """What the loader needs from a multi-rank run (tiermoe.distributed.share.ExpertShare implements it)."""

    rank: int
    num_ranks: int
    holds_cpu_tier: bool  # this process computes the CPU experts (exactly one process does)

    def reduce(self, y_TD: torch.Tensor) -> torch.Tensor: ...

    def cpu_slot(self, layer: int, expert: int) -> ExpertWeights: ...  # host tensors to read a CPU expert into

    def cpu_added(self, layer: int, expert: int, tier) -> None: ...  # the CPU tier took it (kept or converted)


def load_hybrid_model(model_dir: str | Path, placement=None, *, gpu_device: str | torch.device = "cpu",
                      dtype: torch.dtype | None = None, cpu: CPUConfig = CPUConfig(),
                      progress: bool = True, share: RankShare | None = None, trainable: bool = False,
                      lora: MergedLoRA | None = None, attention_backend: str = "auto") -> HybridModel:
    """Load `model_dir` with routed experts placed by `placement`: a PlacementPlan (what the edge hands on), or
    anything `tiermoe.model.plan_source.resolve_plan` turns into one (a bool mask [L, E], True = GPU tier; a
    PlacementConfig; None = the checkpoint's own mask, the environment, or all CPU).

    `gpu_device` is the main device (non-expert weights and GPU-tier experts): "cuda:0" in production, "cpu"
    to run every path without CUDA. `dtype` defaults to the checkpoint's dtype. `cpu` chooses the CPU tier's
    backend, expert format and threads. `share`: this process's part of a multi-rank run (the plan then has one
    GPU rank per process).

    `trainable`: a model to fine-tune (tiermoe.training): transformers' own attention modules and LM head stay as
    they are (their parameter names and layouts are the ones PEFT adapters refer to), and with grad enabled the
    routed experts of both tiers compute through tiermoe.layers.routed_autograd. One process only.

    `cpu.non_expert_dtype` (CPU-only inference): the non-expert linears, once loaded (and merged), are held packed
    in that format (tiermoe.model.non_expert_quant); by default bf16 for a bf16 model run CPU-only, with the CPU
    tier on every core (tiermoe.model.cpu_only).

    Not trainable: RMSNorms and softmax top-k routers whose weights are on the CPU compute as one native call
    each, with the same results (tiermoe.model.fused_layers).

    `lora`: an adapter merged into the weights as they load (tiermoe.model.lora_merge): non-expert weights once
    loaded, each routed expert before its tier takes it (so a quantising CPU tier quantises the merged expert).

    `attention_backend`: what decode rows attend the KV pool in place with (tiermoe.layers.decode_attention's
    decode_attention_for: "auto", "native", "triton", "torch").
    """
    model_dir = Path(model_dir)
    check_attention_backend(attention_backend)
    if trainable and share is not None:
        raise TiermoeError("training runs in one process: a trainable model cannot be one rank of several")
    if lora is not None and trainable:
        raise TiermoeError("a trainable model takes its adapter with tiermoe.training.load_adapter, not merged")
    if lora is not None and share is not None:
        raise TiermoeError("serving with an adapter (--lora) runs in one process; several ranks do not merge one")
    if trainable and cpu.deferred_experts:
        raise TiermoeError("deferred experts (--kt-max-deferred-experts-per-token) approximate inference; a model to "
                           "fine-tune computes every expert in its layer: leave it at 0")
    check_non_expert_dtype(cpu, torch.device(gpu_device), trainable)
    weights_dir, cache = model_dir, find_cache(model_dir)
    if cache is not None:  # a `tiermoe convert` output: CPU-tier experts mapped from it, the rest from its source
        weights_dir = cache.source
        cache.check_source(weight_files(weights_dir))
        cpu, cache = _usable_cache(cache, cpu, lora)
    config = load_config(model_dir)
    spec = detect(config)
    check_transformers_for(spec.model_type)
    if cpu.deferred_experts > spec.top_k:
        raise TiermoeError(f"--kt-max-deferred-experts-per-token {cpu.deferred_experts}: this model routes each token "
                           f"to {spec.top_k} experts, so at most {spec.top_k} can be deferred (0 keeps outputs exact)")
    keep_frame_chunks()  # a step's deep Python calls must not map and unmap a frame-stack chunk per call
    rank, num_ranks = (0, 1) if share is None else (share.rank, share.num_ranks)
    plan = resolve_plan(placement, model_dir, spec, num_ranks, str(gpu_device))
    assignment_LE = plan.assignment
    gpu_device = torch.device(gpu_device)
    dtype = dtype or spec.dtype
    cpu = cpu_only_defaults(cpu, gpu_device, dtype, trainable, share is not None)
    check_head_dtype(cpu)
    # Host copies are worth page-locking only when the GPU tier is on CUDA; shared-memory CPU experts are
    # page-locked by their store (tiermoe.distributed.shm_store), slot by slot, not here.
    pin = pins_host_memory(gpu_device) and share is None

    fp8_block = fp8_block_size(config)
    with open_checkpoint(weights_dir, config, fp8_block) as ckpt:
        sources = {layer: find_expert_source(ckpt, spec, LAYERS_PREFIX, layer) for layer in spec.moe_layers}
        model = build_skeleton(config, dtype)
        if not trainable:
            replace_mla_attention(decoder_layers(model))  # MLA caches its latent (before the weights load into it)
        worker = CPUWorker()
        # a tuned family's activation from its config; any other's from its experts module, as discovery read it
        act = ExpertActivation.from_config(spec.activation, config) if spec.model_type in TUNED else None
        fp8_layers = {layer for layer, src in sources.items() if keeps_fp8(ckpt, src)}
        if lora is not None:
            _check_lora_experts(lora, fp8_layers, assignment_LE == rank)
        pool = ExpertSlotPool(gpu_device)
        blocks = _inject_hybrid_blocks(model, spec, gpu_device, act, worker, pin, cpu, dtype, fp8_layers,
                                       ckpt.fp8_block, (assignment_LE == rank).sum(dim=1).tolist(), pool)
        if share is not None:
            for block in blocks.values():
                block.join_ranks(rank, share.reduce)
        if cpu.deferred_experts and blocks:
            log.warning("deferred experts: per token the %d lowest-weighted of %d routed experts, where on the CPU "
                        "tier, are added in the next MoE layer (an approximation; 0 keeps outputs exact)",
                        cpu.deferred_experts, spec.top_k)
            deferred = DeferredExperts(cpu.deferred_experts, blocks)
            for block in blocks.values():
                block.deferred = deferred
        reads = _reads(assignment_LE, spec, rank, share is None or share.holds_cpu_tier)
        if pin and cache is None:
            _give_slabs(blocks, reads & (assignment_LE == -1), spec, dtype)
        total = _non_expert_bytes(model, ckpt, spec) + _expert_bytes(reads, assignment_LE == rank, fp8_layers,
                                                                      spec, dtype, ckpt.fp8_block)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {model_dir.name}",
                  disable=not progress) as bar:
            _load_fp8_linears(model, ckpt, spec, gpu_device, bar)
            _load_non_experts(model, ckpt, spec, gpu_device, bar)
            move_buffers(model, gpu_device)  # the non-persistent ones the checkpoint does not hold, too
            if lora is not None:
                lora.merge_non_experts(model)  # before MLA's kv_b re-layout and the LM head's swap below
            _load_experts(blocks, sources, ckpt, spec, assignment_LE, reads, rank, share, dtype, pin, bar, cache,
                          lora)
    _log_gpu_tier_kernel(blocks, gpu_device, dtype)
    _tie_and_check(model, config)
    if trainable:
        for block in blocks.values():
            block.trainable = True
    else:
        group_kv_b_rows_of(decoder_layers(model))  # MLA's one re-layout, now that kv_b_proj holds its rows (and
        # before it is packed: each head's W_UK and W_UV then a block of whole strips)
        if cpu.packs_non_experts:  # CPU only: packed linears on the kernels (the head too)
            quantize_non_experts(model, spec.router_attr, cpu, worker)
            for block in blocks.values():
                if isinstance(block, HybridMoE):
                    block.shared_on_team = True  # its shared experts' linears too: see HybridMoE.shared_on_team
        fuse_layer_ops(model)  # CPU-resident norms and routers: one native call each (tiermoe.model.fused_layers)
        if cpu.packs_non_experts:
            pack_routers(model, cpu, worker)
        use_rows_lm_head(model)  # the head on the sampled rows as one 2-D matmul: no copy of its weight per prefill
    return_freed_heap()  # the read buffers the tiers packed or quantised from
    kernels = load_kernels()
    decode_attention = decode_attention_for(model, gpu_device, kernels, model_team(worker, kernels, cpu), trainable,
                                            _in_place_backend(model, attention_backend))
    if isinstance(decode_attention, DecodeAttention):  # the CPU's native kernels: whole layers fused around them
        fuse_decode_attention(model, decode_attention)
        fuse_decode_layers(model, kernels)  # where every piece is fused and packed: one native call a layer
        attach_mla_decode(model, decode_attention)  # MLA's decode attention likewise, in one native call
    return HybridModel(model, config, spec, blocks, gpu_device, worker, model_dir, dtype, share, trainable, pool,
                       decode_attention, torch_threads_beside(cpu))


def _in_place_backend(model: nn.Module, backend: str) -> str:
    """The attention backend decode rows can use: reading the pool in place takes keys and values of one head dim,
    so a transformers MLA module tiermoe has not replaced by its MLAAttention (a family discovery found: query and
    key heads of nope + rope dims, values of another) attends gathered pages, as transformers computes it."""
    generic_mla = sorted({type(m).__name__ for m in model.modules()
                          if hasattr(m, "kv_a_proj_with_mqa") and not isinstance(m, MLAAttention)})
    if not generic_mla or backend == "torch":
        return backend
    log.info("attention: %s attends gathered pages (its keys and values differ in head dim, which the in-place "
             "decode kernels do not take)", ", ".join(generic_mla))
    return "torch"


def _log_gpu_tier_kernel(blocks: dict[int, HybridMoE], device: torch.device, dtype: torch.dtype) -> None:
    """One line per pool at load: which kernel computes the GPU tier on this CUDA device, and why (a CPU "GPU
    tier" is a test device: nothing to say)."""
    if device.type != "cuda":
        return
    tiers = [b.gpu_tier for b in blocks.values() if len(b.gpu_tier)]
    pools = {id(t.pool): t.pool for t in tiers if isinstance(t, SlottedExpertSet)}
    for pool in pools.values():
        choice = pool.kernel(dtype)
        log.info("GPU tier: %s kernel (%s)", choice.name, choice.why)
    if any(isinstance(t, FP8ExpertSet) for t in tiers):
        log.warning("GPU tier: FP8 experts compute one at a time, with 3 + g host syncs per layer per step (%s)",
                    fp8_kernel(device, dtype).why)


def _usable_cache(cache: ExpertCache, cpu: CPUConfig,
                  lora: MergedLoRA | None = None) -> tuple[CPUConfig, ExpertCache | None]:
    """The CPU config that reads `cache` (its format on the native backend), or the given one and no cache,
    with a warning, when the user asked for something the cache does not hold (experts with an adapter merged)."""
    if lora is not None and lora.adapts_experts():
        warnings.warn(f"the CPU-expert cache in {cache.root} holds experts without the adapter's LoRA; converting "
                      f"the merged experts from {cache.source} instead", stacklevel=3)
        return cpu, None
    if cpu.backend == "native" and cpu.expert_dtype in (None, cache.fmt) and cpu.expert_down_dtype in (None,
                                                                                                  cache.down_fmt):
        return replace(cpu, expert_dtype=cache.fmt, expert_down_dtype=cache.down_fmt), cache
    asked = f" --cpu-expert-down-dtype {cpu.expert_down_dtype}" if cpu.expert_down_dtype else ""
    warnings.warn(f"the CPU-expert cache in {cache.root} holds native {cache.fmt} experts (down projections "
                  f"{cache.down_fmt}) but --cpu-backend {cpu.backend} --cpu-expert-dtype {cpu.expert_dtype}{asked} "
                  f"was asked for; converting from {cache.source} instead", stacklevel=3)
    return cpu, None


def _check_lora_experts(lora: MergedLoRA, fp8_layers: set[int], on_gpu_LE: torch.Tensor) -> None:
    """Before anything loads: GPU-tier experts of FP8 layers stay FP8 as stored, so an adapter cannot merge into
    them (that would re-quantise them)."""
    for layer in sorted(fp8_layers):
        if lora.adapts_experts(layer) and bool(on_gpu_LE[layer].any()):
            raise TiermoeError(f"{lora.source} has LoRA on the routed experts of layer {layer}, whose GPU-tier "
                               "experts stay FP8 as stored; merging would re-quantise them, which tiermoe does not "
                               "do: put that layer's experts on the CPU tier")


def _reads(assignment_LE: torch.Tensor, spec, rank: int, holds_cpu_tier: bool) -> torch.Tensor:
    """bool [L, E]: the experts this process reads (its own GPU experts, and the CPU tier's if it holds it)."""
    moe = spec.moe_row_mask()[:, None]
    return moe & ((assignment_LE == rank) | ((assignment_LE == -1) & holds_cpu_tier))


def _expert_bytes(reads_LE, on_gpu_LE, fp8_layers, spec, dtype, block) -> int:
    """Bytes of the experts this process reads, as their tiers take them in: GPU-tier experts of FP8 layers as
    stored, every other expert in `dtype` (the CPU tier's format conversion comes after the read)."""
    fp8_L = torch.zeros(spec.num_layers, dtype=torch.bool)
    fp8_L[list(fp8_layers)] = True
    fp8_LE = reads_LE & on_gpu_LE & fp8_L[:, None]
    fp8 = int(fp8_LE.sum())
    other = int((reads_LE & ~fp8_LE).sum())
    return (fp8 * fp8_expert_bytes(spec, block) if fp8 else 0) + other * spec.bytes_per_expert(dtype)


def _inject_hybrid_blocks(model: nn.Module, spec, gpu_device, act, worker, pin, cpu: CPUConfig,
                          dtype: torch.dtype, fp8_layers: set[int], fp8_block, gpu_experts_L: list[int],
                          pool: ExpertSlotPool) -> dict[int, HybridMoE]:
    """A HybridMoE per MoE layer: in the block's place (a tuned family: spec.block_forward "tiermoe"), or in its
    experts module's place, the block's own forward kept (tiermoe.model.hybrid_experts)."""
    blocks, fp8_pool, torch_tiers = {}, None, {}
    for i, layer in enumerate(decoder_layers(model)):
        block = moe_block(layer, spec.moe_path)
        if (block is not None) != spec.is_moe_layer(i):
            raise RuntimeError(f"layer {i}: transformers built {'a MoE' if block is not None else 'a dense'} block, "
                               f"but discovery says otherwise for {spec.model_type}")
        if block is None:
            continue
        layer_act = act if act is not None else ExpertActivation.of_module(spec.activation, block.experts)
        # FP8 checkpoints: the GPU tier keeps the stored codes (about half of bf16's bytes), in slots of a pool of
        # codes where a kernel decodes them without a host sync (on CUDA), else expert by expert
        if i in fp8_layers and fp8_kernel(gpu_device, dtype).sync_free:
            fp8_pool = fp8_pool or ExpertSlotPool(gpu_device)
            gpu_tier = SlottedFP8ExpertSet(layer_act, spec.num_experts, fp8_pool, fp8_block, dtype)
            fp8_pool.reserve(gpu_experts_L[i])
        elif i in fp8_layers:
            gpu_tier = FP8ExpertSet(gpu_device, layer_act, fp8_block, dtype)
        else:  # slots of the model's pool, sized once for the experts the placement gives this rank
            gpu_tier = SlottedExpertSet(layer_act, spec.num_experts, pool)
            pool.reserve(gpu_experts_L[i])
        cpu_tier = make_cpu_tier(cpu, worker, layer_act, pin, dtype)
        if layer_act.kind not in ACTIVATION_CODES:
            torch_tiers.setdefault(layer_act.name, []).append(i)
        if spec.block_forward == "tiermoe":
            blocks[i] = HybridMoE(block, spec, i, gpu_tier, cpu_tier)
            parent, _, leaf = spec.moe_path.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, leaf, blocks[i])
        elif spec.experts_call == "around":  # the module's own forward stays, its interface call on the tiers
            blocks[i] = HybridExperts(spec, i, gpu_tier, cpu_tier)
            experts_around(block.experts, blocks[i])
        else:
            blocks[i] = (HybridEveryExpert if spec.experts_call == "every_expert" else HybridExperts)(
                spec, i, gpu_tier, cpu_tier)
            block.experts = blocks[i]
    for name, layers in torch_tiers.items():  # once per load: why these layers' CPU tier is not the kernels'
        log.info("CPU tier: the experts of layers %s compute in torch, exactly: their activation (%s) is not one the "
                 "native kernels have", _layer_list(layers), name)
    return blocks


def _layer_list(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 8 else f"{layers[0]}-{layers[-1]} ({len(layers)} layers)"


def _non_expert_bytes(model: nn.Module, ckpt, spec) -> int:
    """Bytes the non-expert weights will take (FP8-stored Linear weights as stored), for the progress bar."""
    return sum(held_nbytes(name, t, spec, ckpt) for name, _, _, t, _ in meta_tensors(model))


def _load_fp8_linears(model: nn.Module, ckpt: Checkpoint, spec, gpu_device, bar) -> None:
    """Swap every nn.Linear whose weight the checkpoint stores as block-scaled FP8 for an FP8Linear on the
    main device (its bias, if any, read alongside); other FP8 tensors are dequantised by `_load_non_experts`."""
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not module.weight.is_meta:
            continue
        disk = disk_name(f"{name}.weight", spec, ckpt)
        if not is_block_fp8(ckpt, disk):
            continue
        weight = ckpt.read(disk).to(gpu_device)
        scale = ckpt.read(scale_name(disk)).to(gpu_device)
        bias = None
        if module.bias is not None:
            bias_disk = disk_name(f"{name}.bias", spec, ckpt)
            if bias_disk is None:
                raise TiermoeError(f"checkpoint has no tensor '{name}.bias', which this {spec.model_type} model needs")
            bias = ckpt.read(bias_disk, torch.empty(module.bias.shape, dtype=module.bias.dtype)).to(gpu_device)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, FP8Linear(weight, scale, ckpt.fp8_block, bias))
        bar.update(weight.nbytes + scale.nbytes + (bias.nbytes if bias is not None else 0))


def _load_non_experts(model: nn.Module, ckpt: Checkpoint, spec, gpu_device, bar) -> None:
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, module, leaf, meta, is_param in list(meta_tensors(model)):
        disk = disk_name(name, spec, ckpt)
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


def _load_experts(blocks, sources: dict[int, ExpertSource], ckpt, spec, assignment_LE, reads_LE, rank, share,
                  dtype, pin, bar, cache: ExpertCache | None = None, lora: MergedLoRA | None = None) -> None:
    for layer, block in blocks.items():
        for e in range(spec.num_experts):
            owner = int(assignment_LE[layer, e])
            block.assign(e, owner)
            if not reads_LE[layer, e]:
                continue  # another rank's GPU expert, or a CPU expert the CPU tier's rank holds
            on_gpu = owner == rank
            tier = block.gpu_tier if on_gpu else block.cpu_tier
            if cache is not None and not on_gpu:  # already converted: mapped, not read and quantised
                stored = cache.read(layer, e)
                tier.add_quantized(e, *stored)
                if share is not None:  # its own packed copy: the shared slot stays empty (swaps fill it)
                    share.cpu_added(layer, e, tier)
                bar.update(sum(t.nbytes for m in stored[:2] for t in m.tensors()))
                continue
            if on_gpu and isinstance(tier, FP8ExpertSet):  # codes and scales as stored, never dequantised
                fp8 = read_fp8_expert(ckpt, sources[layer], e, spec)
                tier.add(e, fp8 if tier.device.type == "cpu" else fp8.to(tier.device))
                bar.update(fp8.nbytes)
                continue
            slab = None if on_gpu else getattr(tier, "host_slab", None)
            if share is not None and not on_gpu:
                # the one host copy, read straight into memory every rank of this host can map
                host = _read_expert_into(ckpt, sources[layer], e, spec, dtype, share.cpu_slot(layer, e))
            elif slab is not None:  # straight into its slot of the layer's page-locked slab
                host = _read_expert_into(ckpt, sources[layer], e, spec, dtype, slab.take(e, tier))
            else:
                host = read_expert(ckpt, sources[layer], e, spec, dtype)
            if lora is not None:
                host = lora.merge_expert(layer, e, host)
            tier.add(e, host)  # a GPU tier copies it into its slot; the host buffer is freed right after
            if share is not None and not on_gpu:
                share.cpu_added(layer, e, tier)
            bar.update(host.nbytes)


def _give_slabs(blocks, cpu_reads_LE: torch.Tensor, spec, dtype: torch.dtype) -> None:
    """One page-locked slab per layer for the CPU experts it will read, on tiers that hold what they are given
    (an ExpertSet); a backend that converts experts copies them away, so pinning them would be wasted."""
    for layer, block in blocks.items():
        n = int(cpu_reads_LE[layer].sum())
        if n and isinstance(block.cpu_tier, ExpertSet):
            block.cpu_tier.host_slab = HostSlab(expert_shapes(spec), dtype, n, pin=True)


def _read_expert_into(ckpt: Checkpoint, src: ExpertSource, expert: int, spec, dtype,
                      out: ExpertWeights) -> ExpertWeights:
    """read_expert, into given host tensors (canonical layout, `dtype`) instead of new ones; returns `out`."""
    i = spec.expert_intermediate_size
    if src.fused is None:
        *first, down_key = src.per_expert_keys(expert)
        for key, part in zip(first, out.gate_up.split(i)):
            ckpt.read(key, part)
        ckpt.read(down_key, out.down)
    elif src.direct:
        gate_up_key, down_key = src.fused_keys()
        ckpt.read(gate_up_key, out.gate_up, index=expert)
        ckpt.read(down_key, out.down, index=expert)
    else:  # transposed or interleaved layouts (GPT-OSS's) are rearranged through an expert-sized buffer anyway
        for dst, value in zip(out.tensors(), read_expert(ckpt, src, expert, spec, dtype).tensors()):
            dst.copy_(value)
    return out


def _tie_and_check(model: nn.Module, config) -> None:
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [name for name, *_ in meta_tensors(model)]
    if left:
        raise TiermoeError(f"checkpoint is missing tensors: {', '.join(left[:5])}")
