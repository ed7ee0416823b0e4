"""Adaptive placement on real routing: three law requests of the ESFT DeepSeek-V2-Lite trace, calibrated on another
task (intent), one token a step, costed with DeepSeek-V2-Lite's experts. An LFU expert cache learns the served task
quickly there. The policy tiermoe ships beats LRU and at least ties LFU in estimated time (the previous one, which
learned once per 2048 tokens whether to follow the workload, stayed near the calibration's placement: 5-17 points
below both). Not >= LFU in hit rate over these first 602 tokens: a deviation from the calibration is followed only
once it carried over to later passes (about 30 tokens here), and valued at the cautious end of the served rates
until a longer check has shown it lasts (about 130 tokens), so that a workload like its calibration is not chased;
that holds it back by 0.4-0.7 points here while it pays 60-75% of LFU's copies. Over the whole traces it is at or
above LFU in estimated tokens/s in every cross-task cell and within 0.11 point of its hit rate (BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiermoe.analysis.dynamic_bench import replay_cost_model
from tiermoe.analysis.trace_replay import replay, trace_passes
from tiermoe.arch import detect
from tiermoe.config import AdaptiveSettings
from tiermoe.placement.adaptive_forecast import shrunk_shares, within_pass_dispersion
from tiermoe.placement.adaptive_policy import AdaptivePolicy
from tiermoe.placement.profiles import load_profile
from tiermoe.routing.trace_convert import detect_layout, read_routing
from tiermoe.stats.io import load_counts
from tiermoe.testing.presets import make_config

DATA = Path(__file__).parent / "data" / "routing"


def test_adaptive_is_at_least_lru_and_lfu_on_another_task():
    passes = trace_passes(read_routing(DATA / "esft_law_requests.txt", "esft-trace"))
    assert passes.num_passes == 602 and passes.counts_PME.shape[1:] == (26, 64)
    intent = read_routing(DATA / "esft_counts_intent.csv", "esft-counts")["logical_count"].double().reshape(-1, 27, 64)[0]
    cost = replay_cost_model(detect(make_config("deepseek_v2", "deepseek-v2-lite")), load_profile("rtx4090"))
    for ratio in (0.15, 0.5):
        runs = {p: replay(passes, p, ratio, cost, intent) for p in ("frequency", "lru", "lfu", "adaptive")}
        adaptive = runs["adaptive"]
        assert adaptive.hit_rate > runs["frequency"].hit_rate + 0.05  # calibration on intent is no guide to law
        lru, lfu = runs["lru"], runs["lfu"]
        assert adaptive.hit_rate > lru.hit_rate + 0.03 and adaptive.time < lru.time  # copies charged alike
        # at 0.15 a tie (0.03% slower): the lighter valuation's swaps late in these 602 tokens pay back after them
        assert adaptive.hit_rate >= lfu.hit_rate - 0.01 and adaptive.time < lfu.time * 1.001
        assert sum(adaptive.swaps_P) <= 4 * passes.num_passes  # the caches' copy budget per step


def test_without_a_calibration_adaptive_follows_the_served_routing_from_the_start():
    """No calibration (a uniform prior): nothing to defend, so the served counts are followed as soon as they rise
    above their noise, without the carry-over check that keeps a calibrated placement from chasing a workload like
    it (gpt-oss-120b's decode trace, which has no calibration: 0.5-1.6 points below LFU with the check, within
    0.1 without)."""
    passes = trace_passes(read_routing(DATA / "esft_law_requests.txt", "esft-trace"))
    cost = replay_cost_model(detect(make_config("deepseek_v2", "deepseek-v2-lite")), load_profile("rtx4090"))
    uniform_LE = torch.ones(passes.num_layers, passes.num_experts, dtype=torch.float64)
    for ratio in (0.15, 0.5):
        lfu = replay(passes, "lfu", ratio, cost)
        uncalibrated = replay(passes, "adaptive", ratio, cost)
        told_uniform = replay(passes, "adaptive", ratio, cost, uniform_LE)  # a calibration, checked before followed
        # told a uniform calibration it waits for the check, then (once the longer check settles, ~130 tokens)
        # swaps under the lighter valuation: 0.2 point more hits at 0.5 for 80% more copies, 2% more time
        assert uncalibrated.time < told_uniform.time and uncalibrated.hit_rate > told_uniform.hit_rate - 0.005
        assert uncalibrated.hit_rate >= lfu.hit_rate - 0.01 and uncalibrated.time < lfu.time


def test_a_request_that_departs_from_its_calibration_is_followed_before_the_first_check_is_scored():
    """The carry-over check's first forecast is read sequentially, on the passes seen so far: Qwen3-30B-A3B's decode
    trace (its first 4 MoE layers: a 4-token prefill, then one token a step) departs from the published heat at once,
    and is followed from the second pass, where waiting for the forecast's 4 passes left the first swaps of a short
    decode to the calibration. A calibration that matches the served routing stays unfollowed, and so does a carry
    that is not plain: three ESFT law requests side by side, calibrated on their own counts, whose shared template
    routes alike for a few positions (a lower end of 0.05-0.12 of the deviation)."""
    trace = DATA / "qwen_route_slice.csv"
    passes = trace_passes(read_routing(trace, detect_layout(trace)))
    served_PLE = passes.counts_PME[:, :4]
    # what is followed does not depend on the cost model (only the swaps' values do): the one the tests above build
    cost = replay_cost_model(detect(make_config("deepseek_v2", "deepseek-v2-lite")), load_profile("rtx4090"))
    heat = load_counts(str(DATA / "heat_qwen3_slice.csv"), 4, 128)
    for prior, followed in ((heat, True), (served_PLE.sum(dim=0).double(), False)):
        policy = AdaptivePolicy(4, 128, cost, None, prior)
        for p in range(3):  # the prefill and two decode steps: the first forecast is 2 of its 4 passes in
            policy.observe(served_PLE[p], int(passes.tokens_P[p]), bool(passes.prefill_P[p]))
        assert policy._lasting_check.short.scored == 0
        assert (policy.lasting_weight > 0.5) == followed
    law = read_routing(DATA / "esft_law_requests.txt", "esft-trace")
    law = trace_passes(dict(law, token_pass=law["token_position"], token_is_prefill=law["token_position"] == 0))
    policy = AdaptivePolicy(26, 64, cost, None, law.total_LE()[list(law.moe_layers)])
    for p in range(4):  # the first forecast opens after the first pass and is scored after the fifth
        policy.observe(law.counts_PME[p], int(law.tokens_P[p]), bool(law.prefill_P[p]))
        assert policy._lasting_check.short.scored == 0 and policy.lasting_weight == 0.0


def _toward(forecast: torch.Tensor, prior: torch.Tensor, served: torch.Tensor) -> float:
    """How far `forecast` lies from `prior` toward `served` (0: at the prior, 1: all the way), along their line."""
    return float(((forecast - prior) * (served - prior)).sum() / ((served - prior) ** 2).sum())


def _moved(policy: AdaptivePolicy, counts_LE: torch.Tensor, num_tokens: int) -> float:
    """How far lasting_rates moved from the calibration toward the pass's own rates (0: not at all, 1: all the way)."""
    per_layer_k = counts_LE.sum(dim=1, keepdim=True).double() / num_tokens
    return _toward(policy.lasting_rates(), policy.prior_share_LE * per_layer_k, counts_LE.double() / num_tokens)


def test_the_first_pass_is_followed_as_far_as_its_tokens_route_unlike_each_other():
    """Before the carry-over check can read anything (after the first pass), the pass's counts are followed as far
    as they depart from the calibration beyond their noise, the noise counted with how alike the pass's tokens route
    (within_pass_dispersion): Qwen3-30B-A3B's prompt (its first 4 MoE layers, 4 tokens) routes about as independent
    tokens would and moves the forecast from the published heat; the first tokens of three ESFT law requests side
    by side are the same token (about 2.4x as alike) and leave it near the calibration, where counting them as
    independent tokens would have moved it two-thirds of the way."""
    cost = replay_cost_model(detect(make_config("deepseek_v2", "deepseek-v2-lite")), load_profile("rtx4090"))
    trace = DATA / "qwen_route_slice.csv"
    qwen = trace_passes(read_routing(trace, detect_layout(trace)))
    prompt_LE, prompt_tokens = qwen.counts_PME[0, :4], int(qwen.tokens_P[0])
    policy = AdaptivePolicy(4, 128, cost, None, load_counts(str(DATA / "heat_qwen3_slice.csv"), 4, 128))
    assert within_pass_dispersion(prompt_LE, prompt_tokens, policy.prior_share_LE) < 1.1
    policy.observe(prompt_LE, prompt_tokens, True)
    assert policy.lasting_weight == 0.0 and _moved(policy, prompt_LE, prompt_tokens) > 0.1  # check: no reading

    law = read_routing(DATA / "esft_law_requests.txt", "esft-trace")
    law = trace_passes(dict(law, token_pass=law["token_position"], token_is_prefill=law["token_position"] == 0))
    first_LE, tokens = law.counts_PME[0], int(law.tokens_P[0])
    policy = AdaptivePolicy(26, 64, cost, None, law.total_LE()[list(law.moe_layers)])
    alike = within_pass_dispersion(first_LE, tokens, policy.prior_share_LE)
    assert 2.0 < alike <= tokens
    policy.observe(first_LE, tokens, True)
    as_independent = shrunk_shares(first_LE.double(), policy.prior_share_LE, policy.settings.z_score)
    served = first_LE.double() / first_LE.sum(dim=1, keepdim=True)
    assert _toward(as_independent, policy.prior_share_LE, served) > 0.5
    assert _moved(policy, first_LE, tokens) < 0.1
    one_token = torch.zeros(26, 64)
    one_token[:, :6] = 1.0
    assert within_pass_dispersion(one_token, 1, policy.prior_share_LE) == 1.0


def test_a_short_decode_values_its_swaps_over_the_tokens_its_forecast_rests_on():
    """Qwen3-30B-A3B's whole decode trace (28-token prompt, 128 decode tokens) against the published heat, at 20% of
    the experts on an H200: both LFU and adaptive spend the copy budget from the first pass, so what each swap is
    valued over decides. Valued over a fixed 4,096 tokens (half the half-life), adaptive's first swaps ranked experts
    by a forecast of 28 tokens as if it held 30x past the request and it stayed 0.28% below LFU; over twice the tokens
    seen it ties. The horizon grows with the evidence, up to half the half-life, and a set one is kept."""
    trace = Path(__file__).parents[1] / "data" / "routing" / "decode-route-traces" / "qwen.route.csv"
    passes = trace_passes(read_routing(trace, detect_layout(trace)))
    heat = load_counts(str(Path(__file__).parents[1] / "data" / "routing" / "qwen3-moe-heat" / "heat_qwen3-30b-a3b.csv"),
                       passes.num_layers, passes.num_experts)
    cost = replay_cost_model(detect(make_config("qwen3_moe", "qwen3-30b-a3b")), load_profile("h200"))
    runs = {p: replay(passes, p, 0.2, cost, heat) for p in ("lfu", "adaptive")}
    assert runs["adaptive"].time <= runs["lfu"].time * 1.0005  # a tie within 0.05% counts (issue 57)
    policy = AdaptivePolicy(passes.num_layers, passes.num_experts, cost, None, heat)
    assert policy.horizon == policy.settings.recent_half_life_tokens  # no evidence yet: the short window
    policy.observe(passes.counts_PME[0], int(passes.tokens_P[0]), True)
    assert policy.horizon == 2 * int(passes.tokens_P[0])
    for p in range(1, passes.num_passes):
        policy.observe(passes.counts_PME[p], int(passes.tokens_P[p]), False)
    assert policy.horizon == pytest.approx(2 * policy._tokens)
    long = AdaptivePolicy(1, 4, cost, AdaptiveSettings(half_life_tokens=64))
    long.observe(torch.ones(1, 4, dtype=torch.float64), 1000, True)
    assert long.horizon == 32  # half the half-life at most
    assert AdaptivePolicy(1, 4, cost, AdaptiveSettings(horizon_tokens=100)).horizon == 100
