"""A loaded hybrid model: the transformers model with HybridMoE blocks, and the tiers behind them.

Placement is read from the blocks' assignments (the one record of it): `assignment` [L, E] (-1 CPU tier, r GPU
rank r), `plan` the same as a PlacementPlan, and the masks derived from it. In a multi-rank run (`share` set, see
tiermoe.distributed) `mask` is the GPU tier as a whole (any rank) and `rank_mask` this rank's own experts; tier
swaps then go through the share, applied by all ranks together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tiermoe.arch.spec import ArchSpec
from tiermoe.errors import TiermoeError
from tiermoe.experts.slot_pool import ExpertSlotPool
from tiermoe.experts.slotted_tier import SlottedExpertSet
from tiermoe.experts.threads import torch_threads
from tiermoe.experts.tiers import CPUWorker
from tiermoe.layers.decode_attention import DecodeAttention
from tiermoe.layers.hybrid_moe import HybridMoE
from tiermoe.placement.mask import validate_mask
from tiermoe.placement.plan import PlacementPlan


@dataclass(frozen=True)
class TierBytes:
    """Bytes held right now: non-expert weights (main device), GPU-tier experts, CPU-tier experts."""

    non_expert: int
    gpu_experts: int
    cpu_experts: int

    def describe(self) -> str:
        gib = 1024**3
        return (f"non-expert {self.non_expert / gib:.2f} GiB, GPU-tier experts {self.gpu_experts / gib:.2f} GiB, "
                f"CPU-tier experts {self.cpu_experts / gib:.2f} GiB")


@dataclass
class SwapStats:
    """Tier swaps so far: experts moved and bytes copied."""

    swaps: int = 0
    bytes: int = 0


class HybridModel:
    """Call it like the transformers model (`hybrid(input_ids=...)`); the MoE blocks split work across tiers."""

    def __init__(self, model: nn.Module, config, spec: ArchSpec, blocks: dict[int, HybridMoE],
                 gpu_device: torch.device, worker: CPUWorker, model_dir: Path, expert_dtype: torch.dtype,
                 share=None, trainable: bool = False, gpu_pool: ExpertSlotPool | None = None,
                 decode_attention: DecodeAttention | None = None, torch_threads: int | None = None):
        self.model = model
        self.config = config
        self.spec = spec
        self.blocks = blocks
        self.gpu_device = gpu_device
        self.model_dir = model_dir
        self.expert_dtype = expert_dtype  # routed experts' dtype in tiermoe's canonical layout
        self._worker = worker
        self.swap_stats = SwapStats()
        self.share = share  # None with one process; this rank's part of a multi-rank run otherwise
        # Decode rows attending the KV pool in place on the CPU (tiermoe.layers.decode_attention), or None.
        self.decode_attention = decode_attention
        self.trainable = trainable  # loaded for fine-tuning: calls keep autograd (tiermoe.training)
        self.gpu_pool = gpu_pool  # the GPU tiers' shared expert slots (tiermoe.experts.slot_pool)
        # torch's intra-op threads during a forward (tiermoe.model.cpu_only); None leaves torch's setting alone.
        self.torch_threads = torch_threads
        # Routing replayed from a trace (tiermoe.layers.trace_routing): engines announce each pass to it first.
        self.routing_override = None

    def __call__(self, *args, **kwargs):
        if self.trainable:
            return self.model(*args, **kwargs)
        with torch.inference_mode(), torch_threads(self.torch_threads):
            return self.model(*args, **kwargs)

    @property
    def cpu_worker(self) -> CPUWorker:
        """The thread that runs the CPU tiers' work (a layer added after loading, e.g. an MTP layer, shares it)."""
        return self._worker

    @property
    def assignment(self) -> torch.Tensor:
        """[L, E] int64: -1 = CPU tier, r >= 0 = GPU rank r (a copy; dense layers' rows are -1)."""
        assignment = torch.full((self.spec.num_layers, self.spec.num_experts), -1, dtype=torch.int64)
        if self.blocks:  # one device-to-host copy for all layers (read between steps by dynamic placement)
            rows = torch.stack([block.assignment_E for block in self.blocks.values()]).to("cpu")
            assignment[list(self.blocks)] = rows
        return assignment

    @property
    def plan(self) -> PlacementPlan:
        """The current placement as a PlacementPlan (what `tiermoe place` writes and every command reads)."""
        num_gpus = 1 if self.share is None else self.share.num_ranks
        return PlacementPlan(self.assignment, num_gpus=num_gpus, strategy="current", model_type=self.spec.model_type)

    @property
    def mask(self) -> torch.Tensor:
        """[L, E] bool, True = on the GPU tier (a copy: change placement with `move_experts` / `apply_mask`)."""
        return self.assignment >= 0

    @property
    def rank_mask(self) -> torch.Tensor:
        """[L, E] bool: the experts this rank's GPU tier holds (= `mask` with one process)."""
        rank = 0 if self.share is None else self.share.rank
        return self.assignment == rank

    def tier_bytes(self) -> TierBytes:
        # Routed experts live in the tiers, not in the module tree, so every model tensor is a non-expert one.
        tensors = {id(t): t for t in list(self.model.parameters()) + list(self.model.buffers())}
        non_expert = sum(t.numel() * t.element_size() for t in tensors.values())
        slotted = [b.gpu_tier for b in self.blocks.values() if isinstance(b.gpu_tier, SlottedExpertSet)]
        pooled = sum({id(t.pool): t.pool.nbytes for t in slotted}.values())  # each pool once: held slots and free
        return TierBytes(
            non_expert=non_expert,
            gpu_experts=pooled + sum(b.gpu_tier.nbytes for b in self.blocks.values()
                                     if not isinstance(b.gpu_tier, SlottedExpertSet)),  # FP8 tiers of no pool
            cpu_experts=sum(b.cpu_tier.nbytes for b in self.blocks.values()),
        )

    def move_experts(self, layer: int, experts: Iterable[int], to_gpu: bool) -> int:
        """Tier swap: move `experts` of MoE layer `layer` to the GPU tier (or back); returns bytes moved."""
        if self.share is not None:
            raise TiermoeError("with several ranks, experts move on every rank at once: queue swaps through the "
                               "share (hybrid.share.queue_swaps) or use dynamic placement")
        if layer not in self.blocks:
            raise ValueError(f"layer {layer} is not a MoE layer; MoE layers are {list(self.spec.moe_layers)}")
        experts = list(experts)
        moved = self.blocks[layer].move_experts(experts, to_gpu)
        self.swap_stats.swaps += len(experts)
        self.swap_stats.bytes += moved
        return moved

    def apply_mask(self, mask) -> int:
        """Move experts so the tiers match `mask` ([L, E] bool); returns the bytes moved."""
        target = validate_mask(mask, self.spec)
        current = self.mask
        moved = 0
        for layer in self.blocks:
            moved += self.move_experts(layer, (current[layer] & ~target[layer]).nonzero().flatten().tolist(), False)
            moved += self.move_experts(layer, (target[layer] & ~current[layer]).nonzero().flatten().tolist(), True)
        return moved

    def close(self) -> None:
        """Stop the CPU worker thread."""
        self._worker.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
