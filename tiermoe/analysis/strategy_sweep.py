"""Expected GPU hit rate of every placement strategy at GPU-tier sizes from 10% to 90% of the routed experts.

For each ratio r the budget is SGLang-kt's floor(r x MoE layers x E) (`total_gpu_experts`), the mask comes from
`tiermoe.placement.strategies.place` on the planning statistics, and the hit rate (share of routed (token,
expert) pairs served by the GPU tier) is measured on the evaluation statistics. Planning and evaluating on the
same counts is in-sample (for `frequency` it is the best any mask can do on them); pass held-out statistics to
see what a placement delivers on prompts it was not planned on.
"""

from __future__ import annotations

import torch

from tiermoe.placement.budget import total_gpu_experts
from tiermoe.placement.metrics import hit_rate
from tiermoe.placement.strategies import DEFAULT_RANDOM_SEED, STRATEGIES, place
from tiermoe.stats.expert_stats import ExpertStats

RATIOS = tuple(round(0.1 * i, 1) for i in range(1, 10))


def strategy_hit_rates(plan_counts_LE: torch.Tensor, moe_rows_L: torch.Tensor,
                       eval_counts_LE: torch.Tensor | None = None,
                       ratios=RATIOS, strategies=STRATEGIES, seed: int = DEFAULT_RANDOM_SEED) -> dict[str, list[float]]:
    """{strategy: [hit rate at each ratio]}.

    Args:
        plan_counts_LE: [L, E] counts the placements are chosen from.
        moe_rows_L: bool [L], True for MoE layers.
        eval_counts_LE: [L, E] counts the hit rate is measured on (default: plan_counts_LE).
    """
    eval_counts_LE = plan_counts_LE if eval_counts_LE is None else eval_counts_LE
    num_moe, num_experts = int(moe_rows_L.sum()), plan_counts_LE.shape[1]
    rates: dict[str, list[float]] = {}
    for strategy in strategies:
        rates[strategy] = []
        for ratio in ratios:
            total = total_gpu_experts(num_moe, num_experts, ratio=ratio)
            mask_LE = place(strategy, moe_rows_L, num_experts, total, plan_counts_LE, seed)
            rates[strategy].append(hit_rate(mask_LE, eval_counts_LE))
    return rates


def strategy_hit_rate_report(stats: ExpertStats, eval_stats: ExpertStats | None = None,
                             seed: int = DEFAULT_RANDOM_SEED) -> dict:
    """The hit-rate section of `tiermoe stats` (tiermoe.routing.summary.report's `hit_rates`): placements from
    `stats`, hit rates measured on `eval_stats` (default: in-sample)."""
    eval_counts = None if eval_stats is None else eval_stats.counts_LE
    return {
        "ratios": list(RATIOS),
        "evaluated_on": list(eval_stats.sources) if eval_stats is not None else "the same statistics (in-sample)",
        "strategies": strategy_hit_rates(stats.counts_LE, stats.moe_rows_L, eval_counts, seed=seed),
    }
