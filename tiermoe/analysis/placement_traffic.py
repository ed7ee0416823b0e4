"""What each placement makes every forward pass do (tiermoe.placement.pass_traffic), from one recorded per_token
trace of the workload.

Routing does not depend on placement (any placement gives the reference logits), so one trace of the held-out
workload fixes every pass's batch and routed experts; a placement only decides, per pass and MoE layer, which
tier computes each distinct expert. Static strategies are one mask for all passes (vectorised). The dynamic
policies follow the rules of `tiermoe.analysis.trace_replay` and the live engine: `dynamic` (KTransformers') runs
prefill passes of at least `prefill_threshold` tokens wholly on the GPU, streaming the CPU-tier experts they
route to, and then keeps each layer's most-used experts; `adaptive` swaps asynchronously, a copy landing (the
mask flipping) only after the copy time has passed in pass time; swaps chosen after a layerwise pass are copied
too, as tiermoe's engine does. Pass times (by which copies land) and the adaptive policy's decisions come from
one cost model (tiermoe.placement.pass_cost).
Legend: P passes, M MoE layers, E experts, S (pass, sequence) rows, R requests.
"""

from __future__ import annotations

import torch

from tiermoe.analysis.trace_replay import ReplayedSwaps, trace_passes
from tiermoe.errors import TiermoeError
from tiermoe.placement.adaptive_policy import AdaptivePolicy, AdaptiveSettings
from tiermoe.placement.budget import total_gpu_experts
from tiermoe.placement.pass_cost import PassCostModel
from tiermoe.placement.pass_traffic import (
    PassShapes,
    Traffic,
    concat_traffic,
    pass_traffic,
    static_traffic,
)
from tiermoe.placement.policies import KTDynamicPolicy
from tiermoe.placement.strategies import NEEDS_STATISTICS, TIME_BALANCED, place
from tiermoe.placement.swap_schedule import SWAP_EXPERTS_IN_FLIGHT

DYNAMIC_STRATEGIES = ("dynamic", "adaptive")
BENCH_STRATEGIES = ("random", "uniform", "front-loading", "frequency", "balanced", TIME_BALANCED) + DYNAMIC_STRATEGIES


def pass_shapes(trace: dict) -> PassShapes:
    """Batches and routing of a per_token trace (tiermoe.stats.traces format)."""
    passes = trace_passes(trace)
    try:
        pass_N = trace["token_pass"].long()
        request_N = trace["token_request"].long()
        position_N = trace["token_position"].long()
        prefill_N = trace["token_is_prefill"].bool()
    except KeyError as err:
        raise TiermoeError(f"not a per_token trace: missing {err}") from None
    pass_N = pass_N - pass_N.min()
    _, request_N = torch.unique(request_N, return_inverse=True)
    num_p, num_r = passes.num_passes, int(request_N.max()) + 1
    key_N = pass_N * num_r + request_N
    keys, inverse = torch.unique(key_N, return_inverse=True)
    context_S = torch.zeros(keys.numel(), dtype=torch.long).scatter_reduce(0, inverse, position_N + 1, "amax")
    first_pass = torch.full((num_r,), num_p, dtype=torch.long).scatter_reduce(0, request_N, pass_N, "amin")
    first_token = torch.full((num_r,), -1, dtype=torch.long).scatter_reduce(
        0, request_N[prefill_N], pass_N[prefill_N], "amax")
    completions_P = torch.bincount(first_token[first_token >= 0], minlength=num_p)
    return PassShapes(
        counts_PME=passes.counts_PME, tokens_P=passes.tokens_P, seqs_P=torch.bincount(keys // num_r, minlength=num_p),
        prefill_P=passes.prefill_P, output_tokens_P=passes.decode_tokens_P + completions_P,
        row_pass_S=keys // num_r, row_tokens_S=torch.bincount(inverse, minlength=keys.numel()),
        row_context_S=context_S, first_pass_R=first_pass, first_token_pass_R=first_token,
        moe_layers=passes.moe_layers, num_layers=passes.num_layers, num_experts=passes.num_experts)


def start_strategy(strategy: str, has_statistics: bool) -> str:
    """The static strategy a bench strategy places with first. `dynamic` starts where KTransformers' tutorial
    starts it (frequency with statistics, else its default, uniform); `adaptive` where its policy starts it
    (time-balanced, else uniform; as tiermoe.analysis.trace_replay does)."""
    if strategy not in BENCH_STRATEGIES:
        raise TiermoeError(f"unknown strategy '{strategy}'; choose from {', '.join(BENCH_STRATEGIES)}")
    base = {"dynamic": "frequency", "adaptive": TIME_BALANCED}.get(strategy, strategy)
    if base in NEEDS_STATISTICS and not has_statistics:
        if strategy not in DYNAMIC_STRATEGIES:
            raise TiermoeError(f"the '{strategy}' strategy needs calibration statistics")
        base = "uniform"
    return base


def strategy_mask(strategy: str, moe_rows_L: torch.Tensor, num_experts: int, ratio: float, calibration_LE,
                  seed: int = 42, cost: PassCostModel | None = None, tokens_per_pass: float = 1.0,
                  pairs_per_token: float | None = None) -> torch.Tensor:
    """The starting mask [L, E] of a bench strategy at a GPU-expert ratio (SGLang-kt's floor(ratio x total)).
    time-balanced (and adaptive, which starts there) also takes the cost model, the decode batch and the top-k."""
    total = total_gpu_experts(int(moe_rows_L.sum()), num_experts, ratio=ratio)
    base = start_strategy(strategy, calibration_LE is not None)
    return place(base, moe_rows_L, num_experts, total, calibration_LE, seed, cost=cost,
                 tokens_per_pass=tokens_per_pass, pairs_per_token=pairs_per_token)


def placement_traffic(shapes: PassShapes, strategy: str, ratio: float, calibration_LE: torch.Tensor | None,
                      cost: PassCostModel, prefill_threshold: int | None = None,
                      adaptive: AdaptiveSettings | None = None, seed: int = 42, tokens_per_pass: float = 1.0,
                      swap_log: list | None = None) -> Traffic:
    """Traffic of `strategy` at `ratio`. `cost` times the passes (copies land by it), times the copies, and is
    what the adaptive policy (and time-balanced) decides with; tokens_per_pass: the decode batch (the requests in
    flight). swap_log: where the adaptive policy's accepted swaps go, as (pass, swap)."""
    m, e = len(shapes.moe_layers), shapes.num_experts
    k = float(shapes.counts_PME.sum()) / max(1, int(shapes.tokens_P.sum()) * m)
    mask_ME = strategy_mask(strategy, shapes.moe_rows_L, e, ratio, calibration_LE, seed, cost, tokens_per_pass,
                            k)[list(shapes.moe_layers)]
    if strategy not in DYNAMIC_STRATEGIES:
        return static_traffic(shapes, mask_ME)
    if strategy == "dynamic":
        policy = KTDynamicPolicy(prefill_threshold or 0)
    else:
        prior = calibration_LE[list(shapes.moe_layers)] if calibration_LE is not None else None
        policy = AdaptivePolicy(m, e, cost, adaptive or AdaptiveSettings(), prior)
    in_flight = max(SWAP_EXPERTS_IN_FLIGHT, (adaptive or AdaptiveSettings()).max_swaps_in_flight)
    return _simulate(shapes, mask_ME, policy, cost, prefill_threshold, swap_log, in_flight)


def _simulate(shapes: PassShapes, mask_ME: torch.Tensor, policy, cost: PassCostModel,
              prefill_threshold: int | None, swap_log: list | None = None,
              max_in_flight: int = SWAP_EXPERTS_IN_FLIGHT) -> Traffic:
    """Pass by pass through the live engine's swap schedule (trace_replay.ReplayedSwaps): swaps chosen after a
    layerwise pass are copied too, as tiermoe's engine does (KTransformers' own update reuses the streamed layer)."""
    rows = []
    swaps_in = ReplayedSwaps(mask_ME, cost.copy_seconds(), max_in_flight)
    fixed_P = cost.fixed_seconds_P(shapes)
    for p in range(shapes.num_passes):
        counts_ME = shapes.counts_PME[p]
        tokens, prefill = int(shapes.tokens_P[p]), bool(shapes.prefill_P[p])
        layerwise = prefill_threshold is not None and prefill and tokens >= prefill_threshold
        row = pass_traffic(counts_ME, mask_ME, layerwise)
        swaps_in.advance(float(fixed_P[p] + cost.moe_seconds_P(row, shapes.tokens_P[p:p + 1])[0]))
        policy.observe(counts_ME, tokens, prefill)
        accepted, copies = swaps_in.after_pass(policy)
        if swap_log is not None:
            swap_log += [(p, swap) for swap in accepted]
        row.swap_copies_P = torch.tensor([copies])
        rows.append(row)
    return concat_traffic(rows)
