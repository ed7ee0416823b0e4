"""Expert swaps across ranks: applied synchronously by every rank at the same step boundary.

A swap promotes `expert_in` of `layer` (CPU tier -> a GPU rank) and demotes `expert_out` of `layer_out` (that GPU
rank -> CPU tier), so every rank keeps exactly as many GPU experts as before and its mask keeps counting only its
own experts. The promoted expert goes to the rank that gave up `expert_out`. A cross-layer swap (`layer_out`
another layer: adaptive placement moves a GPU slot from a cold layer to a hot one) takes the same steps, the
demotion in `layer_out`, the promotion in `layer`: the GPU rank's slot pool hands the freed slot to the other
layer, so its per-layer counts change and its total does not. Unlike one process, where copies run
asynchronously and masks flip on landing, several ranks apply swaps synchronously: rank 0 puts them in the step
plan, and all ranks apply them before that step's forwards. Experts cross between processes through their
shared-memory slots (or, for a rank on another host than rank 0, through the checkpoint, which every host has):
1. the GPU rank writes `expert_out` into its slot; rank 0 writes `expert_in` into its slot unless the CPU tier
   already computes from it there (a backend that converts experts keeps its own copy);
2. barrier; the GPU rank drops `expert_out` and then copies `expert_in` from its slot (or the checkpoint) to its
   GPU, one swap at a time, so its GPU never holds more experts than before;
3. barrier; rank 0's CPU tier takes `expert_out` from its slot (re-read from the checkpoint when the GPU rank is
   on another host; restored as it was stored when the tier kept it, see tiermoe.experts.tiers) and drops
   `expert_in`; the slots it no longer computes from are released; every rank updates its assignment.
The step stalls for the copies (a few ms per expert on PCIe): simpler than overlapping them, and exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tiermoe.checkpoint.fp8 import fp8_block_size
from tiermoe.checkpoint.safetensors import Checkpoint
from tiermoe.engine.update_log import log_update
from tiermoe.experts.weights import ExpertWeights
from tiermoe.model.expert_source import LAYERS_PREFIX, find_expert_source, read_expert
from tiermoe.model.gguf_checkpoint import open_checkpoint
from tiermoe.placement.policies import Swap


@dataclass(frozen=True)
class RankSwap(Swap):
    """A Swap given to the GPU rank that holds its `expert_out` (and receives `expert_in`)."""

    rank: int = field(kw_only=True)


def assign_swaps(hybrid, swaps: list[Swap]) -> list[RankSwap]:
    """Give each swap the GPU rank that holds its `expert_out`; drop swaps that no longer fit the owners
    (an expert named twice, or already moved)."""
    assignment_LE = hybrid.assignment  # a copy, updated as swaps are given ranks
    out = []
    for s in swaps:
        if s.layer not in hybrid.blocks or s.out_layer not in hybrid.blocks:
            continue
        row_in, row_out = assignment_LE[s.layer], assignment_LE[s.out_layer]
        if int(row_in[s.expert_in]) != -1 or int(row_out[s.expert_out]) < 0:
            continue
        rank = int(row_out[s.expert_out])
        row_in[s.expert_in], row_out[s.expert_out] = rank, -1
        out.append(RankSwap(s.layer, s.expert_in, s.expert_out, s.layer_out, rank=rank))
    return out


def apply_swaps(hybrid, share, swaps: list[RankSwap]) -> None:
    """Every rank calls this with the same swaps (from the step plan); see the module docstring."""
    if not swaps:
        return
    started = time.monotonic()
    spec, rank, store = hybrid.spec, share.rank, share.store
    with _CheckpointReader(hybrid) as disk:
        for s in swaps:  # 1.
            if s.rank == rank and share.store_on_this_host:
                store.write(s.out_layer, s.expert_out, hybrid.blocks[s.out_layer].gpu_tier.get(s.expert_out))
            if share.holds_cpu_tier and share.same_host(s.rank) and not share.kept(s.layer):
                store.write(s.layer, s.expert_in, hybrid.blocks[s.layer].cpu_tier.get(s.expert_in))
        share.group.barrier("an expert swap (writing slots)")
        for s in swaps:  # 2.
            if s.rank != rank:
                continue
            host = store.slot(s.layer, s.expert_in) if share.store_on_this_host else disk.read(s.layer, s.expert_in)
            # free before allocating, one swap at a time: the GPU never holds more experts than it did (its
            # memory was sized for them; a cross-layer swap's promotion takes the slot its demotion freed in
            # the other layer); no forward runs until every rank has applied the swaps
            hybrid.blocks[s.out_layer].gpu_tier.pop(s.expert_out)
            gpu = hybrid.blocks[s.layer].gpu_tier
            gpu.add(s.expert_in, host.to(gpu.device))  # always a copy: never alias a slot that 3. releases
        share.group.barrier("an expert swap (reading slots)")
        if share.holds_cpu_tier:  # 3.
            for s in swaps:
                cpu_out = hybrid.blocks[s.out_layer].cpu_tier
                if cpu_out.parked(s.expert_out):  # its stored form was kept: exact, unlike converting the slot's
                    cpu_out.restore(s.expert_out)
                else:
                    if share.same_host(s.rank):
                        host = store.slot(s.out_layer, s.expert_out)
                    else:
                        host = store.write(s.out_layer, s.expert_out, disk.read(s.out_layer, s.expert_out))
                    cpu_out.add(s.expert_out, host)
                hybrid.blocks[s.layer].cpu_tier.pop(s.expert_in)
                store.release(s.layer, s.expert_in)
                if not share.kept(s.out_layer):
                    store.release(s.out_layer, s.expert_out)
    for s in swaps:
        hybrid.blocks[s.layer].assign(s.expert_in, s.rank)
        hybrid.blocks[s.out_layer].assign(s.expert_out, -1)
    moved = 2 * len(swaps) * spec.bytes_per_expert(hybrid.expert_dtype)
    hybrid.swap_stats.swaps += 2 * len(swaps)
    hybrid.swap_stats.bytes += moved
    if rank == 0:  # every rank applies the same swaps: one line for the update
        log_update("every rank, synchronously", [s.layer for s in swaps], len(swaps), moved,
                   time.monotonic() - started)


class _CheckpointReader:
    """Experts read from the checkpoint on demand (swaps with a rank on another host); opened on first use."""

    def __init__(self, hybrid):
        self.hybrid = hybrid
        self._ckpt: Checkpoint | None = None

    def read(self, layer: int, expert: int) -> ExpertWeights:
        if self._ckpt is None:  # the weights the model was loaded from (a conversion cache's source, GGUF)
            config = self.hybrid.config
            self._ckpt = open_checkpoint(self.hybrid.model_dir, config, fp8_block_size(config))
        spec = self.hybrid.spec
        source = find_expert_source(self._ckpt, spec, LAYERS_PREFIX, layer)
        return read_expert(self._ckpt, source, expert, spec, self.hybrid.expert_dtype)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._ckpt is not None:
            self._ckpt.close()
