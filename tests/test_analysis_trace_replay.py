"""Trace replay: static strategies, KT-compatible dynamic, adaptive and the oracles on synthetic traces."""

from __future__ import annotations

import pytest
import torch

from tiermoe.analysis.dynamic_bench import run_dynamic_bench
from tiermoe.analysis.trace_replay import replay, trace_passes
from tiermoe.errors import TiermoeError
from tiermoe.placement.adaptive_policy import AdaptiveSettings
from tiermoe.placement.global_topk import generate_gpu_experts_masks
from tiermoe.placement.metrics import hit_rate
from tiermoe.placement.pass_cost import expert_cost_model
from tiermoe.placement.profiles import GPUProfile
from tiermoe.placement.tier_time import assumed_cpu_tier

E, K = 8, 2
FLOPS_PER_PAIR = 6 * 64 * 32
COST = expert_cost_model(1 << 20, FLOPS_PER_PAIR, GPUProfile("test", 1e12, 1e14, 25e9, 0.0),
                         assumed_cpu_tier(1 << 20, FLOPS_PER_PAIR, read_bandwidth=20e9, flops=4e11))


def make_trace(phases, seed=0, prefill_tokens=0):
    """A 2-layer, E-expert trace: each phase is (passes, tokens per pass, hot experts), routing mostly to hot ones."""
    gen = torch.Generator().manual_seed(seed)
    pass_ids, ids, prefill = [], [], []
    p = 0
    if prefill_tokens:
        pass_ids.append(torch.zeros(prefill_tokens, dtype=torch.int32))
        ids.append(torch.randint(0, E, (prefill_tokens, 2, K), generator=gen))
        prefill.append(torch.ones(prefill_tokens, dtype=torch.bool))
        p = 1
    for passes, tokens, hot in phases:
        for _ in range(passes):
            hot_ids = torch.tensor(hot)[torch.randint(0, len(hot), (tokens, 2, K), generator=gen)]
            cold = torch.randint(0, E, (tokens, 2, K), generator=gen)
            pick = torch.rand(tokens, 2, K, generator=gen) < 0.9
            ids.append(torch.where(pick, hot_ids, cold))
            pass_ids.append(torch.full((tokens,), p, dtype=torch.int32))
            prefill.append(torch.zeros(tokens, dtype=torch.bool))
            p += 1
    n = sum(x.numel() for x in pass_ids)
    all_ids = torch.cat(ids)
    logical = torch.stack([torch.bincount(all_ids[:, m].flatten(), minlength=E) for m in (0, 1)])[None]
    return {"token_pass": torch.cat(pass_ids), "topk_ids": all_ids.to(torch.int16), "logical_count": logical,
            "token_is_prefill": torch.cat(prefill), "token_request": torch.zeros(n, dtype=torch.int32),
            "token_position": torch.arange(n, dtype=torch.int32), "moe_layers": [0, 1], "num_layers": 2,
            "num_experts": E}


def test_static_hit_rates_match_the_mask_on_the_whole_trace():
    trace = make_trace([(50, 4, [0, 1, 2])])
    passes = trace_passes(trace)
    assert int(passes.counts_PME.sum()) == 50 * 4 * 2 * K
    total = passes.total_LE()
    for ratio in (0.0, 0.25, 0.5, 1.0):
        oracle = replay(passes, "oracle-static", ratio, COST)
        assert abs(oracle.hit_rate - hit_rate(generate_gpu_experts_masks(total, int(ratio * 16)), total)) < 1e-12
        freq = replay(passes, "frequency", ratio, COST, calibration_LE=total)
        assert abs(freq.hit_rate - oracle.hit_rate) < 1e-12  # calibrated on the trace itself: it is the oracle
        assert replay(passes, "uniform", ratio, COST).hit_rate <= oracle.hit_rate + 1e-12
    assert replay(passes, "random", 0.0, COST).hit_rate == 0.0
    assert replay(passes, "uniform", 1.0, COST).hit_rate == 1.0


def test_adaptive_follows_a_shifting_workload_and_pays_for_its_copies():
    calibration = trace_passes(make_trace([(200, 4, [0, 1])], seed=1)).total_LE()
    trace = make_trace([(200, 4, [5, 6]), (200, 4, [2, 3])], seed=2)
    settings = AdaptiveSettings(half_life_tokens=64, replan_every=4, margin=2.0)
    adaptive = replay(trace, "adaptive", 0.25, COST, calibration_LE=calibration, adaptive=settings)
    frequency = replay(trace, "frequency", 0.25, COST, calibration_LE=calibration)
    assert adaptive.hit_rate > 1.5 * frequency.hit_rate
    assert adaptive.bytes_copied > 0 and sum(adaptive.swaps_P) > 0
    assert adaptive.time < frequency.time
    window = replay(trace, "oracle-window", 0.25, COST)
    assert window.hit_rate >= adaptive.hit_rate


def test_adaptive_without_locality_is_frequency_and_pays_no_copies():
    # the workload is what calibration saw, token by token independent: nothing to follow
    # (five equally hot experts, two or four GPU slots a layer: noisy counts keep suggesting swaps among them)
    calibration = trace_passes(make_trace([(300, 4, [0, 1, 2, 3, 4])], seed=4)).total_LE()
    trace = make_trace([(300, 4, [0, 1, 2, 3, 4])], seed=5)
    for ratio in (0.25, 0.5):
        adaptive = replay(trace, "adaptive", ratio, COST, calibration_LE=calibration,
                          adaptive=AdaptiveSettings(half_life_tokens=64, replan_every=4, horizon_tokens=1024))
        frequency = replay(trace, "frequency", ratio, COST, calibration_LE=calibration)
        assert adaptive.bytes_copied == 0 and sum(adaptive.swaps_P) == 0
        assert adaptive.hit_rate == frequency.hit_rate and adaptive.time == frequency.time


def test_kt_dynamic_reselects_after_a_large_prefill_only():
    trace = make_trace([(50, 2, [6, 7])], prefill_tokens=300)
    passes = trace_passes(trace)
    first = passes.counts_PME[0]
    kt = replay(passes, "kt-dynamic", 0.25, COST, prefill_threshold=256)
    assert kt.hit_rate_P[0] == 1.0 and kt.copied_bytes_P[0] > 0  # layerwise prefill streamed the CPU experts
    mask_ME = torch.zeros(2, E, dtype=torch.bool)
    for m in (0, 1):  # that batch's two most-used experts per layer (ties: lower id)
        mask_ME[m, torch.sort(first[m].double(), descending=True, stable=True).indices[:2]] = True
    for p in range(1, passes.num_passes):  # decode passes never re-place: they are served by that choice
        counts = passes.counts_PME[p]
        assert abs(kt.hit_rate_P[p] - float(counts[mask_ME].sum()) / float(counts.sum())) < 1e-12
    assert kt.swaps_P[1:] == [0] * (passes.num_passes - 1)
    never = replay(passes, "kt-dynamic", 0.25, COST, prefill_threshold=1000)
    assert sum(never.swaps_P) == 0 and never.hit_rate_P[0] < 1.0


def requests_in_turn(*traces):
    """The traces as requests 0, 1, ... served one after another (passes renumbered)."""
    out, offset = [], 0
    for r, t in enumerate(traces):
        out.append(dict(t, token_pass=t["token_pass"] + offset, token_request=torch.full_like(t["token_request"], r)))
        offset += int(t["token_pass"].max()) + 1
    return {k: (torch.cat([t[k] for t in out]) if isinstance(v, torch.Tensor) and k != "logical_count" else v)
            for k, v in out[0].items()}


def test_the_per_request_oracle_places_each_request_for_its_own_routing():
    first, second = make_trace([(40, 1, [0, 1])], seed=6), make_trace([(60, 1, [5, 6])], seed=7)
    passes = trace_passes(requests_in_turn(first, second))
    assert passes.request_runs_P.tolist() == [0] * 40 + [1] * 60
    expected = 0.0
    for t in (first, second):
        total = trace_passes(t).total_LE()
        expected += float((total * generate_gpu_experts_masks(total, 4)).sum())
    oracle = replay(passes, "oracle-request", 0.25, COST)
    assert abs(oracle.gpu_pairs - expected) < 1e-9 and oracle.bytes_copied == 0
    assert oracle.hit_rate > replay(passes, "oracle-static", 0.25, COST).hit_rate + 0.2  # two hot sets, one budget
    assert replay(passes, "oracle-window", 0.25, COST, window=100).hit_rate == pytest.approx(
        replay(passes, "oracle-static", 0.25, COST).hit_rate)


def test_a_pass_with_other_requests_starts_a_new_oracle_run():
    trace = make_trace([(4, 2, [0, 1])])
    trace["token_request"] = torch.tensor([0, 1, 0, 1, 0, 0, 2, 0], dtype=torch.int32)  # {0,1} {0,1} {0} {0,2}
    assert trace_passes(trace).request_runs_P.tolist() == [0, 0, 1, 2]


def test_a_trace_without_its_requests_has_no_per_request_oracle():
    trace = make_trace([(20, 2, [0, 1])])
    del trace["token_request"]
    passes = trace_passes(trace)
    with pytest.raises(TiermoeError, match="oracle-request needs the trace's requests"):
        replay(passes, "oracle-request", 0.25, COST)
    bench = run_dynamic_bench(passes, COST, ratios=(0.25,))
    assert "oracle-request" not in bench.policies and "oracle-window" in bench.policies


def test_bench_dynamic_command_prints_tables(tmp_path):
    torch.save(make_trace([(30, 4, [0, 1])]), tmp_path / "t.pt")
    torch.save(make_trace([(30, 4, [0, 1])], seed=3), tmp_path / "c.pt")
    from conftest import run_cli, save_tiny

    model = save_tiny("olmoe", tmp_path / "m")
    result = run_cli("bench", "dynamic", "--trace", str(tmp_path / "t.pt"), "--calibration", str(tmp_path / "c.pt"),
                     "--model", str(model), "--ratios", "0.25,0.5", "--plot", str(tmp_path / "d.png"))
    assert result.returncode == 0, result.stderr
    assert "GPU hit rate" in result.stdout and "ESTIMATE" in result.stdout and "adaptive" in result.stdout
    assert (tmp_path / "d.png").stat().st_size > 1000
