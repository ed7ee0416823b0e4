"""From a PlacementConfig and a model's shape to a PlacementPlan.

1. size the GPU tier: a ratio, a per-layer count, or GPU memory and the model's real bytes;
2. choose the experts with the strategy (statistics, if any, loaded by the caller);
3. split them across GPUs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from tiermoe.config import PlacementConfig
from tiermoe.errors import TiermoeError
from tiermoe.placement.budget import (
    GIB,
    MemoryBudget,
    auto_gpu_memory,
    cublas_workspace_bytes,
    forward_threads,
    fp8_transient_bytes,
    total_gpu_experts,
)
from tiermoe.placement.kv_layout import KVLayout
from tiermoe.placement.partition import split_across_gpus
from tiermoe.placement.plan import PlacementPlan
from tiermoe.placement.strategies import NEEDS_STATISTICS, place

# Layers x experts one plan may hold: 268 x DeepSeek-V3's 61 x 256, and 32 MiB per [L, E] int64 tensor. A
# larger shape is a typo (100000 x 100000 would allocate 80 GB per tensor).
MAX_CELLS = 1 << 22
# Bytes planning takes per (layer, expert) cell, generously: counts, sort keys and indices, masks, the assignment.
BYTES_PER_CELL = 64


@dataclass(frozen=True)
class PlacementTarget:
    """What the planner needs to know of a model; byte fields are needed only for --gpu-memory-gb."""

    num_layers: int
    num_experts: int
    moe_layers: tuple[int, ...]
    model_type: str | None = None
    bytes_per_expert: int | None = None
    non_expert_bytes: int | None = None
    kv_bytes_per_token: int | None = None  # full-attention layers (all KV when kv_layout is None)
    kv_layout: KVLayout | None = None  # every layer kind: sliding windows and linear-attention states too
    fp8_dequant_matrix: int = 0  # the largest FP8 non-expert weight, dequantised (bytes); 0 without FP8
    fp8_dequant_expert: int = 0  # one FP8 GPU-tier expert, dequantised (bytes); 0 unless experts stay FP8

    def __post_init__(self):
        if self.num_layers < 1 or self.num_experts < 1:
            raise TiermoeError(f"a model needs >= 1 layer and >= 1 expert, got {self.num_layers} x {self.num_experts}")
        if self.num_layers * self.num_experts > MAX_CELLS:
            raise TiermoeError(f"{self.num_layers} layers x {self.num_experts} experts is more than any model has; "
                               f"tiermoe plans at most {MAX_CELLS} (layer, expert) pairs (DeepSeek-V3: 61 x 256)")
        bad = [layer for layer in self.moe_layers if not 0 <= layer < self.num_layers]
        if bad:
            raise TiermoeError(f"MoE layers {bad} are outside 0..{self.num_layers - 1}")

    @property
    def planning_bytes(self) -> int:
        """Memory planning this shape takes, about (BYTES_PER_CELL per cell)."""
        return self.num_layers * self.num_experts * BYTES_PER_CELL

    @property
    def moe_rows(self) -> torch.Tensor:
        rows = torch.zeros(self.num_layers, dtype=torch.bool)
        rows[list(self.moe_layers)] = True
        return rows


def memory_budget(config: PlacementConfig, target: PlacementTarget, gpu_device: str | None,
                  measured: tuple[int, int] | None = None) -> MemoryBudget:
    """One GPU's split. `measured`: that GPU's (free bytes, margin) for "auto", measured by the process that owns
    it (default: measured here on `gpu_device`). The cuBLAS workspaces are reserved unless the GPU tier is the
    host (gpu_device "cpu")."""
    if target.bytes_per_expert is None or target.non_expert_bytes is None:
        raise TiermoeError("--gpu-memory-gb needs a model (its bytes per expert and non-expert weights); pass --model")
    if config.gpu_memory_gb == "auto":
        gpu_memory, margin = measured or auto_gpu_memory(gpu_device or "cuda:0")
    else:
        gpu_memory, margin = int(float(config.gpu_memory_gb) * GIB), 0
    if target.kv_layout is not None:  # the most any max_running sequences holding kv_cache_tokens in all keep
        kv = target.kv_layout.bytes(config.kv_cache_tokens, config.max_running)
    else:
        kv = config.kv_cache_tokens * (target.kv_bytes_per_token or 0)
    threads = forward_threads(config.max_running)
    on_cuda = str(gpu_device or "cuda") != "cpu"
    workspaces = threads * cublas_workspace_bytes() if on_cuda else 0
    fp8 = fp8_transient_bytes(threads, target.fp8_dequant_matrix, target.fp8_dequant_expert)
    return MemoryBudget(gpu_memory, target.non_expert_bytes, kv, int(config.prefill_buffer_gb * GIB), margin,
                        workspaces, fp8)


def gpu_budgets(config: PlacementConfig, target: PlacementTarget, gpu_device: str | None,
                measured: list[tuple[int, int]] | None = None) -> list[MemoryBudget]:
    """The split of every GPU of the plan. For "auto" each GPU's own free memory counts: `measured` (one entry per
    rank, each measured by its rank), else measured here on the devices the ranks of one machine take
    (gpu_device's index + r, see tiermoe.distributed.group.rank_device). A number of GB is the same for all."""
    if config.gpu_memory_gb != "auto" or (config.num_gpus == 1 and measured is None):
        return [memory_budget(config, target, gpu_device)]
    if measured is None:
        device = torch.device(gpu_device or "cuda:0")
        first, n = device.index or 0, config.num_gpus
        if device.type != "cuda" or first + n > torch.cuda.device_count():
            raise TiermoeError(f"--gpu-memory-gb auto for {n} GPUs measures cuda:{first}..cuda:{first + n - 1}, "
                               "which this machine does not have; plan where the ranks run (tiermoe serve "
                               "--num-gpus measures each rank's own GPU) or give a number of GB")
        measured = [auto_gpu_memory(f"cuda:{first + r}") for r in range(n)]
    if len(measured) != config.num_gpus:
        raise TiermoeError(f"--gpu-memory-gb auto: {len(measured)} GPU(s) measured for a plan of {config.num_gpus}")
    return [memory_budget(config, target, gpu_device, m) for m in measured]


def make_plan(config: PlacementConfig, target: PlacementTarget, counts: torch.Tensor | None = None,
              gpu_device: str | None = None, gpu_memory: list[tuple[int, int]] | None = None) -> PlacementPlan:
    """The plan `config` asks for on `target`. counts: activation counts [L, E] (the statistics file
    `config.init_expert_location` names, loaded by the caller), needed by the frequency and balanced strategies.
    gpu_memory: for --gpu-memory-gb auto, every GPU's (free bytes, margin), each measured by its own rank."""
    if counts is not None and tuple(counts.shape) != (target.num_layers, target.num_experts):
        raise TiermoeError(f"activation counts have shape {list(counts.shape)}, expected "
                           f"[{target.num_layers}, {target.num_experts}] for this model")
    strategy = config.strategy
    if counts is not None and not bool(torch.as_tensor(counts)[list(target.moe_layers)].any()):
        # nothing to rank by: frequency would fill the first layers (every count ties), a split by load divides 0
        fallback = "uniform" if strategy in NEEDS_STATISTICS else strategy
        warnings.warn(f"the activation statistics of {config.init_expert_location or 'this plan'} are all zero "
                      f"(no routed tokens): planned without them (strategy {fallback})", stacklevel=2)
        counts, strategy = None, fallback
    num_moe = len(target.moe_layers)
    budget: dict = {}
    if config.gpu_experts_ratio is not None or config.num_gpu_experts is not None:
        total = total_gpu_experts(num_moe, target.num_experts, config.num_gpu_experts, config.gpu_experts_ratio)
        budget = {"num_gpu_experts_per_layer": config.num_gpu_experts, "gpu_experts_ratio": config.gpu_experts_ratio}
    elif config.gpu_memory_gb is not None:
        # the split gives every GPU the same count: the GPU with the least room sizes them all
        mem = min(gpu_budgets(config, target, gpu_device, gpu_memory), key=lambda b: b.experts)
        per_gpu = mem.experts_that_fit(target.bytes_per_expert, num_moe * target.num_experts)
        total = min(per_gpu * config.num_gpus, num_moe * target.num_experts)
        # kv_cache_tokens: what the engine enforces as its token budget when none is given (tiermoe.engine.llm)
        budget = {"gpu_memory_gb": config.gpu_memory_gb, "bytes_per_expert": target.bytes_per_expert,
                  "experts_bytes_per_gpu": mem.experts, "kv_cache_tokens": config.kv_cache_tokens,
                  "memory": mem.describe()}
    else:
        total = 0
    budget["total_gpu_experts"] = total
    mask = place(strategy, target.moe_rows, target.num_experts, total, counts, config.seed)
    assignment = split_across_gpus(mask, config.num_gpus, config.gpu_split, counts)
    return PlacementPlan(assignment, num_gpus=config.num_gpus, strategy=strategy, budget=budget,
                         gpu_split=config.gpu_split if config.num_gpus > 1 else None, model_type=target.model_type)
