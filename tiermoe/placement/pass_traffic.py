"""What each tier computes in every forward pass of a recorded workload under a placement: the traffic the cost
model (tiermoe.placement.pass_cost) turns into seconds. Pure functions over tensors.

PassShapes are a workload's batches (tiermoe.analysis.placement_traffic.pass_shapes cuts them from a per_token
trace); Traffic is, per pass and MoE layer, the distinct experts and routed pairs each tier computes, whether the
layer's CPU tier is called, and the copies (layerwise prefill streaming, swaps). The split is kept per MoE layer
because the CPU tier overlaps the GPU tier layer by layer, and a layer whose CPU tier holds any expert pays the
CPU call even when the pass routes nothing there.
Legend: P passes, M MoE layers, E experts, S (pass, sequence) rows, R requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PassShapes:
    """The batches of a recorded workload."""

    counts_PME: torch.Tensor  # int64 routed pairs
    tokens_P: torch.Tensor
    seqs_P: torch.Tensor  # sequences in the pass
    prefill_P: torch.Tensor  # bool: any prompt token
    output_tokens_P: torch.Tensor  # tokens sampled at the end of the pass
    row_pass_S: torch.Tensor
    row_tokens_S: torch.Tensor
    row_context_S: torch.Tensor  # KV positions the sequence attends to (cache + this pass)
    first_pass_R: torch.Tensor
    first_token_pass_R: torch.Tensor  # the pass that completes the prompt and samples the first token
    moe_layers: tuple[int, ...]
    num_layers: int
    num_experts: int

    @property
    def num_passes(self) -> int:
        return int(self.tokens_P.numel())

    @property
    def moe_rows_L(self) -> torch.Tensor:
        rows = torch.zeros(self.num_layers, dtype=torch.bool)
        rows[list(self.moe_layers)] = True
        return rows


@dataclass
class Traffic:
    """Per pass and MoE layer, what each tier computes; per pass, layerwise prefill and copies."""

    cpu_distinct_PM: torch.Tensor
    cpu_pairs_PM: torch.Tensor
    gpu_distinct_PM: torch.Tensor
    gpu_pairs_PM: torch.Tensor
    cpu_called_PM: torch.Tensor  # bool: the layer's CPU tier holds experts and the pass is not layerwise
    layerwise_P: torch.Tensor  # bool: the pass ran every expert on the GPU
    streamed_P: torch.Tensor  # experts streamed to the GPU by layerwise prefill
    swap_copies_P: torch.Tensor  # expert copies started for swaps (two per swap)

    @property
    def pairs(self) -> int:
        return int(self.cpu_pairs_PM.sum() + self.gpu_pairs_PM.sum())

    @property
    def hit_rate(self) -> float:
        return float(self.gpu_pairs_PM.sum()) / max(1, self.pairs)

    def cpu_expert_reads(self) -> int:
        return int(self.cpu_distinct_PM.sum())

    def copied_experts(self) -> int:
        return int(self.streamed_P.sum() + self.swap_copies_P.sum())

    def swaps(self) -> int:
        return int(self.swap_copies_P.sum()) // 2


def split_by_tier(counts_PME: torch.Tensor, mask_PME: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(CPU distinct, CPU pairs, GPU distinct, GPU pairs) [P, M] of routed pairs under masks (broadcast to
    [P, M, E])."""
    touched = counts_PME > 0
    gpu = mask_PME.expand_as(counts_PME)
    return ((touched & ~gpu).sum(-1), (counts_PME * ~gpu).sum(-1), (touched & gpu).sum(-1),
            (counts_PME * gpu).sum(-1))


def masked_traffic(counts_PME: torch.Tensor, mask_PME: torch.Tensor) -> Traffic:
    """Traffic of passes that copy nothing: routed pairs [P, M, E] under a mask per pass (or [1, M, E] for all)."""
    cpu_d, cpu_p, gpu_d, gpu_p = split_by_tier(counts_PME, mask_PME)
    num_p = counts_PME.shape[0]
    called = (~mask_PME).any(-1).expand(num_p, -1).clone()
    zeros = torch.zeros(num_p, dtype=torch.long)
    return Traffic(cpu_d, cpu_p, gpu_d, gpu_p, called, torch.zeros(num_p, dtype=torch.bool), zeros, zeros.clone())


def static_traffic(shapes: PassShapes, mask_ME: torch.Tensor) -> Traffic:
    """Traffic of one fixed mask [M, E] over all passes."""
    return masked_traffic(shapes.counts_PME, mask_ME[None])


def pass_traffic(counts_ME: torch.Tensor, mask_ME: torch.Tensor, layerwise: bool = False) -> Traffic:
    """Traffic of one pass (routed pairs [M, E]) under `mask_ME`. layerwise: the pass runs every expert it routes
    to on the GPU tier, the CPU-tier ones streamed there (layerwise GPU prefill), and the CPU tier is not called."""
    cpu_d, cpu_p, gpu_d, gpu_p = split_by_tier(counts_ME[None], mask_ME[None])
    streamed = int(cpu_d.sum()) if layerwise else 0
    if layerwise:
        cpu_d, cpu_p, gpu_d, gpu_p = cpu_d * 0, cpu_p * 0, cpu_d + gpu_d, cpu_p + gpu_p
    called = ((~mask_ME).any(-1) & (not layerwise))[None]
    return Traffic(cpu_d, cpu_p, gpu_d, gpu_p, called, torch.tensor([layerwise]), torch.tensor([streamed]),
                   torch.tensor([0]))


def concat_traffic(rows: list[Traffic]) -> Traffic:
    """One Traffic of consecutive passes."""
    return Traffic(*(torch.cat([getattr(r, f) for r in rows]) for f in (
        "cpu_distinct_PM", "cpu_pairs_PM", "gpu_distinct_PM", "gpu_pairs_PM", "cpu_called_PM", "layerwise_P",
        "streamed_P", "swap_copies_P")))
