"""What each placement makes every forward pass do, from one recorded per_token trace of the workload.

Routing does not depend on placement (any placement gives the reference logits), so one trace of the held-out
workload fixes every pass's batch and routed experts; a placement only decides, per pass and MoE layer, which
tier computes each distinct expert. Static strategies are one mask for all passes (vectorised). The dynamic
policies follow the rules of `tiermoe.analysis.trace_replay` and the live engine: `dynamic` (KTransformers') runs
prefill passes of at least `prefill_threshold` tokens wholly on the GPU, streaming the CPU-tier experts they
route to, and then keeps each layer's most-used experts; `adaptive` swaps asynchronously, a copy landing (the
mask flipping) only after the copy time has passed in pass time; swaps chosen after a layerwise pass are copied
too, as tiermoe's engine does. Unlike replay, the tier split is kept per MoE
layer, because the CPU tier overlaps the GPU tier layer by layer, and a layer whose CPU tier holds any expert
pays the CPU call even when the pass routes nothing there.
Legend: P passes, M MoE layers, E experts, S (pass, sequence) rows, R requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiermoe.analysis.trace_replay import CopiesInFlight, trace_passes
from tiermoe.errors import TiermoeError
from tiermoe.placement.budget import total_gpu_experts
from tiermoe.placement.cost import BandwidthCostModel
from tiermoe.placement.policies import AdaptivePolicy, AdaptiveSettings, KTDynamicPolicy
from tiermoe.placement.strategies import NEEDS_STATISTICS, place

DYNAMIC_STRATEGIES = ("dynamic", "adaptive")
BENCH_STRATEGIES = ("random", "uniform", "front-loading", "frequency", "balanced") + DYNAMIC_STRATEGIES


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


def _split(counts_PME: torch.Tensor, mask_ME: torch.Tensor) -> tuple[torch.Tensor, ...]:
    touched = counts_PME > 0
    gpu = mask_ME.expand_as(counts_PME)
    return ((touched & ~gpu).sum(-1), (counts_PME * ~gpu).sum(-1), (touched & gpu).sum(-1),
            (counts_PME * gpu).sum(-1))


def static_traffic(shapes: PassShapes, mask_ME: torch.Tensor) -> Traffic:
    """Traffic of one fixed mask [M, E] over all passes."""
    cpu_d, cpu_p, gpu_d, gpu_p = _split(shapes.counts_PME, mask_ME[None])
    num_p = shapes.num_passes
    called = (~mask_ME).any(-1)[None].expand(num_p, -1).clone()
    zeros = torch.zeros(num_p, dtype=torch.long)
    return Traffic(cpu_d, cpu_p, gpu_d, gpu_p, called, torch.zeros(num_p, dtype=torch.bool), zeros, zeros.clone())


def start_strategy(strategy: str, has_statistics: bool) -> str:
    """The static strategy a bench strategy places with first. `dynamic` starts where KTransformers' tutorial
    starts it (frequency with statistics, else its default, uniform); `adaptive` where its policy starts it
    (frequency, else uniform; tiermoe.placement.policies.AdaptivePolicy, as tiermoe.analysis.trace_replay does)."""
    if strategy not in BENCH_STRATEGIES:
        raise TiermoeError(f"unknown strategy '{strategy}'; choose from {', '.join(BENCH_STRATEGIES)}")
    base = {"dynamic": "frequency", "adaptive": "frequency"}.get(strategy, strategy)
    if base in NEEDS_STATISTICS and not has_statistics:
        if strategy not in DYNAMIC_STRATEGIES:
            raise TiermoeError(f"the '{strategy}' strategy needs calibration statistics")
        base = "uniform"
    return base


def strategy_mask(strategy: str, moe_rows_L: torch.Tensor, num_experts: int, ratio: float, calibration_LE,
                  seed: int = 42) -> torch.Tensor:
    """The starting mask [L, E] of a bench strategy at a GPU-expert ratio (SGLang-kt's floor(ratio x total))."""
    total = total_gpu_experts(int(moe_rows_L.sum()), num_experts, ratio=ratio)
    base = start_strategy(strategy, calibration_LE is not None)
    return place(base, moe_rows_L, num_experts, total, calibration_LE, seed)


def placement_traffic(shapes: PassShapes, strategy: str, ratio: float, calibration_LE: torch.Tensor | None,
                      pass_seconds: Callable[[int, Traffic], float], cost: BandwidthCostModel,
                      prefill_threshold: int | None = None, adaptive: AdaptiveSettings | None = None,
                      seed: int = 42) -> Traffic:
    """Traffic of `strategy` at `ratio`. pass_seconds(p, one-pass Traffic) times a pass (dynamic policies land
    copies by it); `cost` is what the adaptive policy decides with and how long a copy takes."""
    m, e = len(shapes.moe_layers), shapes.num_experts
    mask_ME = strategy_mask(strategy, shapes.moe_rows_L, e, ratio, calibration_LE, seed)[list(shapes.moe_layers)]
    if strategy not in DYNAMIC_STRATEGIES:
        return static_traffic(shapes, mask_ME)
    if strategy == "dynamic":
        policy = KTDynamicPolicy(prefill_threshold or 0)
    else:
        prior = calibration_LE[list(shapes.moe_layers)] if calibration_LE is not None else None
        policy = AdaptivePolicy(m, e, cost, adaptive or AdaptiveSettings(), prior)
    return _simulate(shapes, mask_ME, policy, pass_seconds, cost, prefill_threshold)


def _simulate(shapes: PassShapes, mask_ME: torch.Tensor, policy, pass_seconds, cost: BandwidthCostModel,
              prefill_threshold: int | None) -> Traffic:
    rows = []
    in_flight = CopiesInFlight()
    for p in range(shapes.num_passes):
        counts_ME = shapes.counts_PME[p]
        tokens, prefill = int(shapes.tokens_P[p]), bool(shapes.prefill_P[p])
        layerwise = prefill_threshold is not None and prefill and tokens >= prefill_threshold
        cpu_d, cpu_p, gpu_d, gpu_p = _split(counts_ME[None], mask_ME[None])
        streamed = int(cpu_d.sum()) if layerwise else 0
        if layerwise:  # every expert the pass routes to runs on the GPU, the CPU-tier ones streamed there
            cpu_d, cpu_p, gpu_d, gpu_p = cpu_d * 0, cpu_p * 0, cpu_d + gpu_d, cpu_p + gpu_p
        called = ((~mask_ME).any(-1) & (not layerwise))[None]
        row = Traffic(cpu_d, cpu_p, gpu_d, gpu_p, called, torch.tensor([layerwise]), torch.tensor([streamed]),
                      torch.tensor([0]))
        seconds = pass_seconds(p, row)
        in_flight.advance(seconds, mask_ME)
        policy.observe(counts_ME, tokens, prefill)
        copies = 0
        for swap in policy.propose(mask_ME, in_flight.busy(mask_ME)):
            # as the live engine does it: both copies start now, in the background (KTransformers' own update
            # reuses the streamed layer instead; tiermoe copies, so the measured run and this agree)
            copies += 2
            in_flight.start(swap, cost.copy_seconds())
        row.swap_copies_P = torch.tensor([copies])
        rows.append(row)
    return Traffic(*(torch.cat([getattr(r, f) for r in rows]) for f in (
        "cpu_distinct_PM", "cpu_pairs_PM", "gpu_distinct_PM", "gpu_pairs_PM", "cpu_called_PM", "layerwise_P",
        "streamed_P", "swap_copies_P")))
