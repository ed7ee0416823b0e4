"""What a MoE layer costs beyond the sum of its two tiers when both compute on one CPU.

With the GPU tier on the CPU device, the caller thread computes the GPU tier's experts while the CPU tier's worker
computes the others: they take turns on the caches, the memory bus and the GIL, so a layer in which both tiers
work costs more than the two tiers timed alone (measured on the 2-core dev box: about a quarter of a millisecond
per layer for the demo model). This times every MoE layer with a split of experts that no validation uses (by
default 75% on the GPU tier), a decode-sized batch, best of many calls, against the cost model's prediction for
those very calls; the difference per layer is the cost model's `both_tiers_seconds`.
Legend: T tokens, K top-k, E experts, M MoE layers.
"""

from __future__ import annotations

import time

import torch

from tiermoe.benchmarking.pass_cost import PassCostModel
from tiermoe.benchmarking.placement_traffic import Traffic, strategy_mask


def measure_both_tiers_seconds(hybrid, model: PassCostModel, ratio: float = 0.75, tokens: int = 8,
                               repeats: int = 40) -> dict:
    """Time all MoE layers at `ratio` (uniform split) on `tokens` random rows; returns the extra seconds per
    layer in which both tiers computed (may be negative: some overlap), with what was measured and predicted.
    The experts are put back where they were."""
    spec = hybrid.spec
    original = hybrid.mask
    blocks = list(hybrid.blocks.values())
    gen = torch.Generator().manual_seed(0)
    try:
        hybrid.apply_mask(strategy_mask("uniform", spec.moe_row_mask(), spec.num_experts, ratio, None))
        x_TD = torch.randn(tokens, spec.hidden_size, generator=gen).to(hybrid.gpu_device, hybrid.expert_dtype)
        with torch.inference_mode():
            ids = [getattr(b, spec.router_attr)(x_TD)[2] for b in blocks]  # each layer's routed ids [T, K]
            masks = [b.host_mask_E.clone() for b in blocks]
            best = float("inf")
            for _ in range(repeats + 1):
                start = time.perf_counter()
                for block in blocks:
                    block.forward_tokens(x_TD[None])
                best = min(best, time.perf_counter() - start)
    finally:
        hybrid.apply_mask(original)
    traffic = _traffic(ids, masks, spec.num_experts)
    tokens_P = torch.tensor([tokens])
    predicted = float(model.moe_seconds_P(traffic, tokens_P)[0]) + \
        len(blocks) * model.host.op_seconds * model.model.per_layer.ops
    both = int(((traffic.cpu_distinct_PM > 0) & (traffic.gpu_distinct_PM > 0)).sum())
    return {"both_tiers_seconds": (best - predicted) / max(1, both), "measured_seconds": best,
            "predicted_seconds": predicted, "layers_with_both_tiers": both, "ratio": ratio, "tokens": tokens}


def _traffic(ids: list[torch.Tensor], masks: list[torch.Tensor], num_experts: int) -> Traffic:
    """One pass's Traffic from each layer's routed ids [T, K] and GPU mask [E]."""
    counts_ME = torch.stack([torch.bincount(i.reshape(-1).cpu(), minlength=num_experts) for i in ids])
    mask_ME = torch.stack([m.cpu() for m in masks])
    touched = counts_ME > 0
    one = lambda t: t[None]  # noqa: E731 - a pass axis of one
    zero = torch.zeros(1, dtype=torch.long)
    return Traffic(one((touched & ~mask_ME).sum(-1)), one((counts_ME * ~mask_ME).sum(-1)),
                   one((touched & mask_ME).sum(-1)), one((counts_ME * mask_ME).sum(-1)), one((~mask_ME).any(-1)),
                   torch.zeros(1, dtype=torch.bool), zero, zero.clone())
