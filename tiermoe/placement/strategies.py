"""Placement strategies: a GPU-expert budget and the model's MoE layers in, a bool mask [L, E] out.

Legend: L layers (dense ones included), M MoE layers, E experts per layer. `moe_rows_L` is bool [L], True for
MoE layers; dense rows of every result are all False. `total` is the number of GPU experts over all layers.
The first four follow SGLang-kt exactly (same inputs, same masks); `balanced` is tiermoe's own, and so is
`time-balanced`, which also needs the cost model: the placement with the least expected step time
(tiermoe.placement.tier_balance), which where the GPU tier is slower balances the two tiers instead of maximising hits.
"""

from __future__ import annotations

import torch

from tiermoe.errors import TiermoeError
from tiermoe.placement.global_topk import (
    clean_counts,
    generate_gpu_experts_masks,
    top_k_positions,
)
from tiermoe.placement.pass_cost import PassCostModel
from tiermoe.placement.tier_balance import PassMix, balance_by_time, rates_from_counts

COMPATIBLE_STRATEGIES = ("uniform", "front-loading", "random", "frequency")
STRATEGIES = COMPATIBLE_STRATEGIES + ("balanced",)
TIME_BALANCED = "time-balanced"  # needs the cost model too (place's `cost`), so not among STRATEGIES
NEEDS_STATISTICS = ("frequency", "balanced", TIME_BALANCED)
DEFAULT_RANDOM_SEED = 42


def _moe_layers(moe_rows_L: torch.Tensor) -> list[int]:
    return moe_rows_L.nonzero().flatten().tolist()


def uniform_mask(moe_rows_L: torch.Tensor, num_experts: int, total: int) -> torch.Tensor:
    """total // M per MoE layer, the first total % M MoE layers one more, each capped at E (overflow dropped);
    within a layer experts 0..c-1."""
    layers = _moe_layers(moe_rows_L)
    mask = torch.zeros(len(moe_rows_L), num_experts, dtype=torch.bool)
    if not layers or total <= 0:
        return mask
    base, extra = divmod(total, len(layers))
    for i, layer in enumerate(layers):
        mask[layer, :min(base + (1 if i < extra else 0), num_experts)] = True
    return mask


def front_loading_mask(moe_rows_L: torch.Tensor, num_experts: int, total: int) -> torch.Tensor:
    """Fill MoE layers in ascending order, each with its lowest expert ids, until the budget runs out."""
    mask = torch.zeros(len(moe_rows_L), num_experts, dtype=torch.bool)
    remaining = max(0, total)
    for layer in _moe_layers(moe_rows_L):
        take = min(remaining, num_experts)
        mask[layer, :take] = True
        remaining -= take
    return mask


def random_mask(
    moe_rows_L: torch.Tensor, num_experts: int, total: int, seed: int = DEFAULT_RANDOM_SEED
) -> torch.Tensor:
    """A seeded random permutation of the layer-major list of MoE (layer, expert) positions; its first `total`."""
    layers = _moe_layers(moe_rows_L)
    mask = torch.zeros(len(moe_rows_L), num_experts, dtype=torch.bool)
    positions = len(layers) * num_experts
    if positions == 0 or total <= 0:
        return mask
    chosen = torch.randperm(positions, generator=torch.Generator().manual_seed(seed))[:min(total, positions)]
    rows = torch.tensor(layers)[chosen // num_experts]
    mask[rows, chosen % num_experts] = True
    return mask


def frequency_mask(counts_LE, moe_rows_L: torch.Tensor, total: int) -> torch.Tensor:
    """Global top-`total` of the statistics over MoE layers (KTransformers' generate_gpu_experts_masks)."""
    counts = _check_counts(counts_LE, moe_rows_L)
    if bool(moe_rows_L.all()):
        return generate_gpu_experts_masks(counts, total)
    # Dense rows must never win a tie against zero-count MoE experts: rank them below everything.
    ranked = torch.where(moe_rows_L[:, None], counts, torch.full_like(counts, -torch.inf))
    k = max(0, min(total, int(moe_rows_L.sum()) * counts.shape[1]))
    mask = torch.zeros(counts.numel(), dtype=torch.bool)
    mask[top_k_positions(ranked, k)] = True
    return mask.reshape(counts.shape)


def within_layer_rank(counts_LE: torch.Tensor) -> torch.Tensor:
    """[L, E] long: 0 for each layer's busiest expert, 1 for the next, ... (ties: lower id first)."""
    order = torch.sort(counts_LE, dim=1, descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(1, order, torch.arange(counts_LE.shape[1]).expand_as(order))


def balanced_mask(counts_LE, moe_rows_L: torch.Tensor, total: int) -> torch.Tensor:
    """Frequency-driven placement that keeps every MoE layer covered and spreads ties across layers.

    Every MoE layer serves the same tokens x top-k pairs, so an expert's count is the hit mass it adds.
    1. If the budget allows one expert per MoE layer, each MoE layer gets its busiest expert first (the original
       can leave layers with none, and with flat or missing statistics piles the budget into a few layers).
    2. The rest goes greedily by hit mass, highest first, so the marginal hit mass is equalised across layers.
       Equal counts go to the layer whose candidate ranks higher within its layer, then the lower layer: with
       flat statistics the budget is dealt out layer by layer instead of filling the first layers.
    """
    counts = _check_counts(counts_LE, moe_rows_L).clamp(min=0)
    layers = _moe_layers(moe_rows_L)
    num_layers, num_experts = counts.shape
    mask = torch.zeros(num_layers, num_experts, dtype=torch.bool)
    k = max(0, min(total, len(layers) * num_experts))
    if k == 0:
        return mask
    rank_LE = within_layer_rank(counts)
    if k >= len(layers):
        mask[layers] = rank_LE[layers] == 0
    candidates = [(-float(counts[layer, e]), int(rank_LE[layer, e]), layer, e)
                  for layer in layers for e in range(num_experts) if not mask[layer, e]]
    for _, _, layer, expert in sorted(candidates)[:k - int(mask.sum())]:
        mask[layer, expert] = True
    return mask


def time_balanced_mask(counts_LE, moe_rows_L: torch.Tensor, total: int, cost: PassCostModel, tokens_per_pass: float,
                       pairs_per_token: float) -> torch.Tensor:
    """The placement of `total` GPU experts with the least expected step time under `cost` for the statistics'
    routing (tier_balance.balance_by_time), from the better of frequency's and uniform's masks: on a GPU beside a
    CPU it is frequency's; where the GPU tier is slower per expert it balances the tiers. tokens_per_pass: the
    decode batch the placement serves (the running sequences); pairs_per_token: the model's top-k."""
    counts = _check_counts(counts_LE, moe_rows_L)
    num_experts = counts.shape[1]
    starts = [frequency_mask(counts, moe_rows_L, total), uniform_mask(moe_rows_L, num_experts, total)]
    return balance_by_time(rates_from_counts(counts, pairs_per_token), moe_rows_L, starts, cost,
                           PassMix.of(tokens_per_pass))


def _check_counts(counts_LE, moe_rows_L: torch.Tensor) -> torch.Tensor:
    counts = clean_counts(counts_LE)
    if counts.shape[0] != len(moe_rows_L):
        raise TiermoeError(f"statistics have {counts.shape[0]} layers, the model has {len(moe_rows_L)}")
    return counts


def place(strategy: str, moe_rows_L: torch.Tensor, num_experts: int, total: int, counts_LE=None,
          seed: int = DEFAULT_RANDOM_SEED, cost: PassCostModel | None = None, tokens_per_pass: float = 1.0,
          pairs_per_token: float | None = None) -> torch.Tensor:
    """Dispatch by strategy name (SGLang-kt spelling; `front_loading` accepted too). `time-balanced` also takes
    the cost model, the decode batch and the model's top-k (time_balanced_mask)."""
    strategy = strategy.replace("_", "-")
    if strategy not in STRATEGIES + (TIME_BALANCED,):
        raise TiermoeError(f"unknown placement strategy '{strategy}'; choose one of: {', '.join(STRATEGIES)}"
                           f", {TIME_BALANCED}")
    if strategy in NEEDS_STATISTICS and counts_LE is None:
        raise TiermoeError(f"the '{strategy}' strategy needs activation statistics (--init-expert-location FILE.pt); "
                           "record them with `tiermoe record`, or choose uniform")
    if strategy == "uniform":
        return uniform_mask(moe_rows_L, num_experts, total)
    if strategy == "front-loading":
        return front_loading_mask(moe_rows_L, num_experts, total)
    if strategy == "random":
        return random_mask(moe_rows_L, num_experts, total, seed)
    if strategy == "frequency":
        return frequency_mask(counts_LE, moe_rows_L, total)
    if strategy == TIME_BALANCED:
        if cost is None or pairs_per_token is None:
            raise TiermoeError(f"the '{TIME_BALANCED}' strategy needs the cost model and the model's top-k")
        return time_balanced_mask(counts_LE, moe_rows_L, total, cost, tokens_per_pass, pairs_per_token)
    return balanced_mask(counts_LE, moe_rows_L, total)
