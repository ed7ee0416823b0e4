"""Placement by the tiers' time per step (tiermoe.placement.tier_balance): where the GPU tier is the faster one the
time-balanced placement is frequency's, where it is the slower one it balances the tiers and beats both uniform and
frequency, and adaptive, which starts there, values its swaps by the step time they change. Small slices of the
ESFT law trace (three requests), costed with DeepSeek-V2-Lite's experts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tiermoe.analysis.concurrent_trace import interleave
from tiermoe.analysis.dynamic_bench import replay_cost_model
from tiermoe.analysis.host_cost_fit import fit_host_costs, fit_this_cpu
from tiermoe.analysis.placement_traffic import (
    pass_shapes,
    placement_traffic,
    strategy_mask,
)
from tiermoe.analysis.trace_replay import trace_passes
from tiermoe.arch import detect
from tiermoe.placement.budget import total_gpu_experts
from tiermoe.placement.model_costs import ModelCosts
from tiermoe.placement.pass_cost import HostCosts, PassCostModel
from tiermoe.placement.pass_traffic import static_traffic
from tiermoe.placement.profiles import GPUProfile, load_profile
from tiermoe.placement.strategies import frequency_mask, place
from tiermoe.placement.tier_balance import (
    PassMix,
    rates_from_counts,
    step_seconds,
    swap_values,
)
from tiermoe.placement.tier_time import TierFit
from tiermoe.routing.generator import RequestRouting, RoutingShape
from tiermoe.routing.trace_convert import read_routing
from tiermoe.testing.presets import make_config

DATA = Path(__file__).parent / "data" / "routing"
SPEC = detect(make_config("deepseek_v2", "deepseek-v2-lite"))
BYTES, FLOPS = SPEC.bytes_per_expert(torch.bfloat16), 2.0 * SPEC.params_per_expert
# the real-size law run on this CPU (BENCHMARKS.md, 2026-12-05): the native CPU tier's a and b, the "GPU" tier
# (torch on one core) 145 us an expert and 1,618 us a routed pair: 17x slower per pair
CPU_TIER = TierFit(346e-6, 96e-6, 0.0, 0.0, 0)
GPU_ON_CPU = TierFit(145e-6, 1618e-6, 0.0, 0.0, 0)


def this_cpu(overlap: bool) -> PassCostModel:
    profile = GPUProfile("this-cpu", 8.9e9, 1e10, 8e9, 1.7e-6)
    return PassCostModel(profile, ModelCosts.experts_only(BYTES, FLOPS), CPU_TIER, HostCosts(0.0, 0.0, 0.0),
                         device_is_host=True, tiers_overlap=overlap, gpu_tier=GPU_ON_CPU)


@pytest.fixture(scope="module")
def side_by_side():
    """The three law requests decoded side by side (one token of each a pass), calibrated on their own counts."""
    trace = read_routing(DATA / "esft_law_requests.txt", "esft-trace")
    position = trace["token_position"]
    trace = dict(trace, token_pass=position, token_is_prefill=position == 0)
    return pass_shapes(trace), trace_passes(trace).total_LE()


def test_where_the_cpu_tier_is_the_bottleneck_time_balanced_is_frequency():
    counts = read_routing(DATA / "esft_counts_intent.csv", "esft-counts")["logical_count"]
    intent = counts.double().reshape(-1, 27, 64)[0]
    rows = intent.sum(dim=1) > 0
    for profile in ("rtx4090", "h200"):
        cost = replay_cost_model(SPEC, load_profile(profile))
        for ratio in (0.1, 0.4):
            total = total_gpu_experts(int(rows.sum()), 64, ratio=ratio)
            mask = place("time-balanced", rows, 64, total, intent, cost=cost, tokens_per_pass=1, pairs_per_token=6)
            assert torch.equal(mask, frequency_mask(intent, rows, total))
        promote, _ = swap_values(cost, PassMix.of(1), rates_from_counts(intent, 6), torch.zeros_like(intent).bool())
        # what an expert saves is its CPU tier time, within the GPU tier's own work (hidden in most passes)
        rate = rates_from_counts(intent, 6)[5, :8]
        cpu_time = rate * cost.cpu.per_expert + rate * cost.cpu.per_pair
        assert torch.allclose(promote[5, :8], cpu_time, rtol=0.05)


@pytest.mark.parametrize("overlap", [False, True])
def test_where_the_gpu_tier_is_slower_time_balanced_and_adaptive_beat_uniform_and_frequency(side_by_side, overlap):
    shapes, own = side_by_side
    cost = this_cpu(overlap)
    tokens = int(shapes.output_tokens_P.sum())
    for ratio in (0.1, 0.9):
        speed = {}
        for strategy in ("uniform", "frequency", "time-balanced", "adaptive"):
            traffic = placement_traffic(shapes, strategy, ratio, own, cost, tokens_per_pass=3)
            speed[strategy] = tokens / float(cost.pass_seconds_P(shapes, traffic).sum())
        best_static = max(speed["uniform"], speed["frequency"])
        assert speed["time-balanced"] >= best_static and speed["adaptive"] >= best_static * 0.999, (ratio, speed)
        mask = strategy_mask("time-balanced", shapes.moe_rows_L, 64, ratio, own, cost=cost, tokens_per_pass=3,
                             pairs_per_token=6)
        assert int(mask.sum()) == total_gpu_experts(26, 64, ratio=ratio)  # the budget, all of it
    # a slower GPU tier takes the experts with the fewest routed pairs: the opposite of frequency's choice
    mask = strategy_mask("time-balanced", shapes.moe_rows_L, 64, 0.3, own, cost=cost, tokens_per_pass=3,
                         pairs_per_token=6)
    hits = lambda m: float((own * m).sum() / own.sum())
    assert hits(mask) < hits(strategy_mask("uniform", shapes.moe_rows_L, 64, 0.3, own))


def test_the_expected_step_time_follows_the_passes_where_a_tier_is_often_idle(side_by_side):
    """One token a step on a real GPU at 0.8: a pass that touches one CPU-tier expert waits for it, though the GPU
    tier's mean time is the larger; the expected maximum (idle or busy tiers, Clark's formula) sees it, the larger
    of the two means would not."""
    trace = read_routing(DATA / "esft_law_requests.txt", "esft-trace")
    passes = trace_passes(trace)
    cost = replay_cost_model(SPEC, load_profile("rtx4090"))
    own = passes.total_LE()[list(passes.moe_layers)]
    rate = rates_from_counts(own, 6)
    mask = frequency_mask(own, torch.ones(26, dtype=torch.bool), total_gpu_experts(26, 64, ratio=0.8))
    traffic = static_traffic(pass_shapes(trace), mask)
    replayed = float(cost.moe_seconds_P(traffic, passes.tokens_P).sum()) / passes.num_passes
    assert step_seconds(cost, rate, mask, PassMix.of(1)) == pytest.approx(replayed, rel=0.1)
    # the larger of the means alone (no spread, no idle passes) is far off
    no_spread = replace(cost, tiers_overlap=True)
    means = (rate * ~mask).sum(1) * (cost.cpu.per_expert + cost.cpu.per_pair)
    gpu = no_spread.gpu_tier_seconds((rate * mask).sum(1), (rate * mask).sum(1), called=0.0)
    assert float(torch.maximum(means, gpu).sum()) < 0.85 * replayed


def test_on_this_cpu_the_fit_corrects_a_forward_that_costs_less_than_its_estimate(side_by_side):
    shapes, _ = side_by_side
    model = this_cpu(False)
    truth = replace(model, host=HostCosts(0.0, 0.0, 2e-3), forward_correction_seconds=-0.05, both_tiers_seconds=1e-3)
    runs = []
    for ratio in (0.0, 0.75, 1.0):
        mask = strategy_mask("uniform", shapes.moe_rows_L, 64, ratio, None)[list(shapes.moe_layers)]
        traffic = static_traffic(shapes, mask)
        runs.append((f"uniform@{ratio:g}", traffic, truth.pass_seconds_P(shapes, traffic).tolist()))
    fitted = fit_this_cpu(model, shapes, runs)
    assert fitted.forward_correction_seconds == pytest.approx(-0.05, rel=1e-6)
    assert fitted.host.sequence_seconds == pytest.approx(2e-3, rel=1e-6)
    assert fitted.both_tiers_seconds == pytest.approx(1e-3, rel=1e-6)
    carried = fit_host_costs(model, shapes, runs)  # what a GPU profile's estimate takes: never below 0
    assert carried.host.step_seconds == 0.0 and carried.forward_correction_seconds == 0.0


def test_concurrent_conversations_interleave_as_the_server_batches_them():
    shape = RoutingShape(2, 8, 2)
    ids = lambda n, e: torch.full((n, 2, 2), e, dtype=torch.int16)
    slots = [[RequestRouting(0, 0, ids(3, 1)), RequestRouting(0, 1, ids(2, 2))], [RequestRouting(1, 2, ids(4, 3))]]
    trace = interleave(slots, shape)
    assert trace["token_pass"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    assert trace["token_request"].tolist() == [0, 2, 0, 2, 0, 2, 1, 2, 1]
    assert trace["token_position"].tolist() == [0, 0, 1, 1, 2, 2, 0, 3, 1]
    assert trace["token_is_prefill"].tolist() == [True, True, False, False, False, False, True, False, False]
    assert trace["topk_ids"][:, 0, 0].tolist() == [1, 3, 1, 3, 1, 3, 2, 3, 2]
    passes = trace_passes(trace)
    assert passes.tokens_P.tolist() == [2, 2, 2, 2, 1] and passes.request_runs_P is not None
