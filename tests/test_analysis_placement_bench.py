"""`tiermoe bench placement`: workloads, exact traffic replay, the cost model, the live path and the CLI (the GPU
check: tests/test_gpu_check.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import run_cli as cli
from conftest import save_char_tokenizer, save_tiny

from tiermoe.analysis.host_cost_fit import fit_host_costs, measure_op_seconds
from tiermoe.analysis.model_op_count import count_decode_step, measure_model_costs
from tiermoe.analysis.placement_bench import (
    PlacementBenchConfig,
    run_placement_bench,
    ttft_seconds,
)
from tiermoe.analysis.placement_live import measure_configuration
from tiermoe.analysis.placement_traffic import (
    pass_shapes,
    placement_traffic,
    strategy_mask,
)
from tiermoe.analysis.placement_workload import WorkloadSpec, build_workloads
from tiermoe.analysis.tier_time_fit import fit_abc
from tiermoe.analysis.trace_replay import TracePasses, replay
from tiermoe.analysis.workload_runs import make_engine, record_trace
from tiermoe.engine.llm import LLM
from tiermoe.errors import TiermoeError
from tiermoe.placement.model_costs import ModelCosts, OpCount
from tiermoe.placement.pass_cost import HostCosts, PassCostModel, expert_cost_model
from tiermoe.placement.pass_traffic import static_traffic
from tiermoe.placement.profiles import GPUProfile, load_profile, save_profile
from tiermoe.placement.tier_time import TierFit

REPO = Path(__file__).resolve().parent.parent
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("placement") / "m")
    save_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """40 short chat requests of different lengths, each its own conversation."""
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    lines = []
    for i in range(40):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 6))
        lines.append(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": text}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def spec_of(dataset, **kw) -> WorkloadSpec:
    return WorkloadSpec(str(dataset), **{"num_prompts": 6, "calibration_prompts": 6, "output_len": 8,
                                         "max_prompt_tokens": 120, "heldout_fraction": 0.5, **kw})


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, progress=False) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def workloads(llm, dataset):
    return build_workloads(spec_of(dataset), lambda p: llm.chat_prompt_ids(p.chat_messages()))


@pytest.fixture(scope="module")
def shapes(llm, workloads):
    return pass_shapes(record_trace(llm, workloads[1], 4, 512))


def test_calibration_and_held_out_prompts_never_share_a_conversation(llm, dataset, workloads):
    calibration, heldout = workloads
    assert set(calibration.prompt_names).isdisjoint(heldout.prompt_names)
    assert calibration.num_requests == heldout.num_requests == 6
    assert all(4 <= n <= 8 for n in heldout.output_lens)
    again = build_workloads(spec_of(dataset), lambda p: llm.chat_prompt_ids(p.chat_messages()))
    assert again == workloads  # seeded: the same prompts and lengths every time


def test_too_few_prompts_is_a_user_error(llm, dataset):
    from tiermoe.errors import TiermoeError

    with pytest.raises(TiermoeError, match="held-out prompts"):
        build_workloads(spec_of(dataset, num_prompts=500), lambda p: llm.chat_prompt_ids(p.chat_messages()))


def test_pass_shapes_account_for_every_token_and_request(shapes, workloads):
    heldout = workloads[1]
    assert int(shapes.output_tokens_P.sum()) == heldout.output_tokens
    assert int(shapes.tokens_P.sum()) == heldout.prompt_tokens + heldout.output_tokens - heldout.num_requests
    assert int(shapes.row_tokens_S.sum()) == int(shapes.tokens_P.sum())
    assert int(shapes.seqs_P.max()) <= 4  # the concurrency
    assert bool((shapes.first_pass_R <= shapes.first_token_pass_R).all())


@pytest.mark.parametrize("strategy", ["random", "uniform", "front-loading", "frequency", "balanced"])
def test_static_traffic_matches_trace_replay(shapes, strategy):
    calibration = shapes.counts_PME.sum(0).double()
    calibration_LE = torch.zeros(shapes.num_layers, shapes.num_experts, dtype=torch.float64)
    calibration_LE[list(shapes.moe_layers)] = calibration
    for ratio in (0.0, 0.25, 0.5, 1.0):
        mask = strategy_mask(strategy, shapes.moe_rows_L, shapes.num_experts, ratio, calibration_LE)
        traffic = static_traffic(shapes, mask[list(shapes.moe_layers)])
        passes = TracePasses(shapes.counts_PME, shapes.tokens_P, shapes.prefill_P, shapes.tokens_P * 0,
                             shapes.moe_layers, shapes.num_layers, shapes.num_experts)
        expected = replay(passes, strategy, ratio, expert_cost_model(1 << 20, 0.0), calibration_LE)
        assert traffic.hit_rate == pytest.approx(expected.hit_rate, abs=1e-12)
        assert traffic.cpu_expert_reads() * (1 << 20) == sum(expected.cpu_bytes_P)
    assert static_traffic(shapes, torch.ones(len(shapes.moe_layers), shapes.num_experts, dtype=torch.bool)
                          ).hit_rate == 1.0


def test_the_live_path_counts_exactly_what_the_replay_predicts(llm, workloads, shapes):
    calibration, heldout = workloads
    for strategy, ratio in (("uniform", 0.5), ("front-loading", 0.25)):
        timing, traffic = measure_configuration(llm, heldout, strategy, ratio, None, 4, 512, None)
        mask = strategy_mask(strategy, shapes.moe_rows_L, shapes.num_experts, ratio, None)
        predicted = static_traffic(shapes, mask[list(shapes.moe_layers)])
        assert traffic["pairs"] == predicted.pairs
        assert traffic["gpu_pairs"] / traffic["pairs"] == pytest.approx(predicted.hit_rate)
        assert traffic["cpu_expert_reads"] == predicted.cpu_expert_reads()
        assert len(timing.step_seconds) == shapes.num_passes and timing.output_tokens == heldout.output_tokens
        assert all(t > 0 for t in timing.ttft_seconds)


def test_dynamic_policies_stream_and_swap_in_the_replay(shapes):
    calibration_LE = torch.ones(shapes.num_layers, shapes.num_experts, dtype=torch.float64)
    cost = expert_cost_model(1 << 20, 0.0, GPUProfile("copies land at once", 1e12, 1e14, 1e15, 0.0))
    dynamic = placement_traffic(shapes, "dynamic", 0.25, calibration_LE, cost, prefill_threshold=8)
    assert bool(dynamic.layerwise_P.any()) and int(dynamic.streamed_P.sum()) > 0
    assert dynamic.hit_rate > static_traffic(shapes, strategy_mask(
        "frequency", shapes.moe_rows_L, shapes.num_experts, 0.25, calibration_LE)[list(shapes.moe_layers)]).hit_rate
    adaptive = placement_traffic(shapes, "adaptive", 0.25, None, cost)
    assert adaptive.swaps() * 2 == int(adaptive.swap_copies_P.sum())
    assert not bool(adaptive.layerwise_P.any())


def small_costs(**kw) -> ModelCosts:
    fields = dict(per_forward=OpCount(100, 80), per_layer=OpCount(20, 15), per_cpu_call=OpCount(5, 4),
                  per_expert=OpCount(10, 8), forward_bytes=1_000_000, sequence_flops=1e6, token_flops=2e6,
                  attention_flops_per_context=1e3, kv_bytes_per_token=1000, bytes_per_expert=1 << 20,
                  flops_per_pair=6e6, hidden_bytes=512, num_moe_layers=2, num_experts=8)
    return ModelCosts(**{**fields, **kw})


def test_the_tiers_combine_from_overlap_to_interference(shapes):
    profile = GPUProfile("test", 1e11, 1e12, 1e10, 1e-6)
    cpu = TierFit(1e-4, 1e-6, 2e-5, 0.0, 0)
    host = HostCosts(1e-5, 1e-4, 1e-4)
    mask = strategy_mask("uniform", shapes.moe_rows_L, shapes.num_experts, 0.5, None)[list(shapes.moe_layers)]
    traffic = static_traffic(shapes, mask)
    one_cpu = PassCostModel(profile, small_costs(), cpu, host, device_is_host=True, tiers_overlap=False)
    overlap = replace(one_cpu, tiers_overlap=True)
    interfere = replace(one_cpu, both_tiers_seconds=1e-4)
    beside = replace(one_cpu, device_is_host=False, tiers_overlap=True)
    t_one, t_overlap = one_cpu.pass_seconds_P(shapes, traffic), overlap.pass_seconds_P(shapes, traffic)
    assert bool((t_overlap <= t_one + 1e-12).all()) and float(t_overlap.sum()) < float(t_one.sum())
    assert float(interfere.pass_seconds_P(shapes, traffic).sum()) > float(t_one.sum())
    assert bool((beside.pass_seconds_P(shapes, traffic) <= t_overlap + 1e-12).all())
    # one CPU: the CPU tier's measured time adds to everything else, exactly
    cpu_part = cpu.seconds(traffic.cpu_distinct_PM.double(), traffic.cpu_pairs_PM.double(),
                           traffic.cpu_called_PM.double()).sum(-1)
    no_cpu = replace(one_cpu, cpu=TierFit(0.0, 0.0, 0.0, 0.0, 0))
    assert torch.allclose(t_one - no_cpu.pass_seconds_P(shapes, traffic), cpu_part)
    ttft = ttft_seconds(shapes, t_one)
    assert len(ttft) == len(shapes.first_pass_R) and min(ttft) > 0


def test_host_costs_are_recovered_from_timed_runs(shapes):
    profile = GPUProfile("this-cpu", 1e10, 1e11, 1e10, 1e-6)
    truth = HostCosts(7e-6, 3e-4, 1e-3)  # per sequence: 100 ops x 7 us dispatch + 0.3 ms more
    model = PassCostModel(profile, small_costs(), TierFit(1e-4, 1e-6, 2e-5, 0.0, 0), truth, True, False, 2e-4)
    runs = []
    for ratio in (0.0, 0.75, 1.0):
        mask = strategy_mask("uniform", shapes.moe_rows_L, shapes.num_experts, ratio, None)[list(shapes.moe_layers)]
        traffic = static_traffic(shapes, mask)
        runs.append((f"r{ratio}", traffic, model.pass_seconds_P(shapes, traffic).tolist()))
    fitted = fit_host_costs(replace(model, host=HostCosts(truth.op_seconds, 0.0, 0.0), both_tiers_seconds=0.0),
                            shapes, runs)
    assert fitted.host.op_seconds == truth.op_seconds
    assert fitted.host.step_seconds == pytest.approx(truth.step_seconds, rel=1e-6, abs=1e-12)
    assert fitted.host.sequence_seconds == pytest.approx(truth.sequence_seconds, rel=1e-6, abs=1e-12)
    assert fitted.both_tiers_seconds == pytest.approx(2e-4, rel=1e-6)  # only the split run has both tiers
    assert fitted.host.fit["runs"]["r0.75"]["fitted_seconds"] == pytest.approx(sum(runs[1][2]), rel=1e-9)
    overlap = [(label, traffic, (torch.tensor(s, dtype=torch.float64) - 3e-4 * ((traffic.cpu_distinct_PM > 0) & (
        traffic.gpu_distinct_PM > 0)).sum(-1)).tolist()) for label, traffic, s in runs]
    assert fit_host_costs(fitted, shapes, overlap).both_tiers_seconds == pytest.approx(-1e-4, rel=1e-6)  # may be < 0


def test_a_timed_gpu_tier_costs_exactly_what_was_timed(shapes):
    profile = GPUProfile("this-cpu", 1e9, 1e11, 1e10, 1e-6)
    gpu = TierFit(3e-4, 2e-6, 5e-5, 0.0, 0)
    model = PassCostModel(profile, small_costs(), TierFit(0.0, 0.0, 0.0, 0.0, 0), HostCosts(0.0, 0.0, 0.0), True,
                          False, gpu_tier=gpu)
    ones = torch.ones(len(shapes.moe_layers), shapes.num_experts, dtype=torch.bool)
    traffic = static_traffic(shapes, ones)
    # every timed term: a per expert, b per pair, c per call where the tier computes (not in an idle layer)
    called = (traffic.gpu_distinct_PM > 0).double()
    expected = gpu.seconds(traffic.gpu_distinct_PM.double(), traffic.gpu_pairs_PM.double(), called).sum(-1)
    assert float(called.min()) == 1.0 and torch.allclose(model.moe_seconds_P(traffic, shapes.tokens_P), expected)
    one = torch.ones((), dtype=torch.float64)  # what the adaptive policy decides with on this CPU: the same a, b
    assert float(model.expert_seconds(True, one, 10 * one)) == pytest.approx(3e-4 + 10 * 2e-6)


def test_the_policies_weigh_an_expert_as_the_pass_estimate_charges_it(shapes):
    """Moving one expert to the GPU tier changes the estimate by exactly what expert_seconds says it saves."""
    profile = GPUProfile("this-cpu", 1e9, 1e11, 1e10, 1e-6)
    model = PassCostModel(profile, small_costs(), TierFit(1e-4, 1e-6, 2e-5, 0.0, 0), HostCosts(0.0, 0.0, 0.0), True,
                          False, gpu_tier=TierFit(3e-4, 2e-6, 5e-5, 0.0, 0))
    mask = strategy_mask("uniform", shapes.moe_rows_L, shapes.num_experts, 0.25, None)[list(shapes.moe_layers)]
    expert = int((~mask[0]).nonzero()[0])
    moved = mask.clone()
    moved[0, expert] = True
    saved = (model.moe_seconds_P(static_traffic(shapes, mask), shapes.tokens_P)
             - model.moe_seconds_P(static_traffic(shapes, moved), shapes.tokens_P)).sum()
    pairs_P = shapes.counts_PME[:, 0, expert].double()
    touched_P = (pairs_P > 0).double()
    expected = (model.expert_seconds(False, touched_P, pairs_P) - model.expert_seconds(True, touched_P, pairs_P)).sum()
    assert float(saved) == pytest.approx(float(expected), rel=1e-9)


def test_dispatch_cost_is_measured_per_op():
    from tiermoe.experts.ffn import ExpertActivation

    op = measure_op_seconds(ExpertActivation("silu_glu"))
    assert 1e-7 < op < 1e-3


def test_cpu_fit_recovers_a_b_c_and_keeps_them_non_negative():
    rows = torch.tensor([[d, p, 1.0] for d in (0, 1, 2, 4, 8) for p in (0, 4, 64) if (d == 0) == (p == 0)],
                        dtype=torch.float64)
    fit = fit_abc(rows, rows @ torch.tensor([2e-4, 3e-6, 5e-5], dtype=torch.float64))
    assert (fit.per_expert, fit.per_pair, fit.per_call) == pytest.approx((2e-4, 3e-6, 5e-5), rel=1e-6)
    negative = fit_abc(rows, rows @ torch.tensor([2e-4, -1e-6, 5e-5], dtype=torch.float64))
    assert min(negative.per_expert, negative.per_pair, negative.per_call) >= 0


def test_model_costs_count_the_work_of_a_pass(llm):
    before = llm.placement.clone()
    costs = measure_model_costs(llm, lambda m: make_engine(m, 1, 64))
    assert torch.equal(llm.placement, before)  # the placement is restored
    assert costs.per_expert.ops >= costs.per_expert.kernels > 0
    assert costs.per_forward.ops > costs.per_layer.ops > 0 and costs.per_cpu_call.ops > 0
    assert costs.bytes_per_expert == 3 * 64 * 32 * 4 and costs.num_moe_layers == 2


def test_the_gpu_tiers_grouped_gemm_costs_the_same_ops_whatever_its_experts(llm):
    """A decode step of 4 sequences routes to more distinct experts than one of 1; with the GPU tier's grouped
    GEMM (torch >= 2.10 runs it on the CPU as well) each MoE block dispatches the same ops, and the counted model
    says so: per layer and per GPU-tier call, nothing per expert. (Counted expert by expert, the model charged 13
    more ops per distinct expert and made the per-layer count up by subtracting k of them from the block's.)"""
    spec = llm.hybrid.spec
    costs = measure_model_costs(llm, lambda m: make_engine(m, 1, 64))
    assert costs.grouped_gemm and costs.gpu_call.ops > 0 and costs.per_layer.kernels > 0
    before = llm.placement.clone()
    try:
        llm.hybrid.apply_mask(spec.moe_row_mask()[:, None].expand(-1, spec.num_experts).clone())
        block_ops, _ = count_decode_step(llm, lambda m: make_engine(m, 4, 64), sequences=4)
    finally:
        llm.hybrid.apply_mask(before)
    per_block = OpCount(block_ops[0] / spec.num_moe_layers, block_ops[1] / spec.num_moe_layers)
    assert per_block == costs.per_layer + costs.gpu_call


def test_one_forward_reads_the_weights_once_whatever_its_sequences(shapes):
    """Every pass is one forward over its sequences (the KV pool): its non-expert weights cost one read."""
    profile = GPUProfile("test", 1e11, 1e14, 1e10, 1e-6)
    costs = small_costs(kv_bytes_per_token=0, sequence_flops=0.0, token_flops=0.0, attention_flops_per_context=0.0)
    model = PassCostModel(profile, costs, TierFit(0.0, 0.0, 0.0, 0.0, 0), HostCosts(0.0, 0.0, 0.0))
    assert int(shapes.seqs_P.max()) > 1
    once = costs.forward_bytes / profile.memory_bandwidth + profile.launch_overhead * costs.per_forward.kernels
    layers = profile.launch_overhead * costs.per_layer.kernels * costs.num_moe_layers
    assert torch.allclose(model.fixed_seconds_P(shapes), torch.full((shapes.num_passes,), once + layers,
                                                                      dtype=torch.float64))
    per_sequence = replace(model, host=HostCosts(0.0, 1e-3, 2e-3))  # host time: per step and per sequence
    assert torch.allclose(per_sequence.fixed_seconds_P(shapes), 1e-3 + 2e-3 * shapes.seqs_P.double() + layers)


def test_the_gpu_tier_dispatches_per_call_or_per_expert_as_its_path_does():
    distinct = torch.tensor([1.0, 8.0, 32.0], dtype=torch.float64)
    pairs = 2 * distinct
    host = HostCosts(6e-6, 0.0, 0.0)
    grouped = small_costs(grouped_gemm=True, gpu_call=OpCount(40, 27))
    fused = PassCostModel(GPUProfile("sm90", 4.8e12, 1e15, 5e10, 4e-6, fused_grouped_gemm=True), grouped,
                          TierFit(0.0, 0.0, 0.0, 0.0, 0), host)
    roofline = torch.maximum(distinct * grouped.bytes_per_expert / 4.8e12, pairs * grouped.flops_per_pair / 1e15)
    assert torch.allclose(fused.gpu_tier_seconds(distinct, pairs),
                          torch.maximum(torch.full_like(distinct, 40 * 6e-6), 27 * 4e-6 + roofline))
    looped = replace(fused, profile=replace(fused.profile, fused_grouped_gemm=False))  # 2 launches per expert
    assert torch.allclose(looped.gpu_tier_seconds(distinct, pairs),
                          torch.maximum(torch.full_like(distinct, 40 * 6e-6), (27 + 2 * distinct) * 4e-6 + roofline))
    loop = replace(fused, model=replace(grouped, grouped_gemm=False))  # expert by expert: ops per expert
    assert torch.allclose(loop.gpu_tier_seconds(distinct, pairs), torch.maximum(
        (40 + 10 * distinct) * 6e-6, (27 + 8 * distinct) * 4e-6 + roofline))
    idle = fused.gpu_tier_seconds(torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    assert float(idle) == 0.0  # a layer whose GPU tier computes nothing does not call it
    one = torch.ones((), dtype=torch.float64)  # one expert's worth leaves the call out
    assert float(fused.expert_seconds(True, one, one)) == pytest.approx(float(roofline[0]))


def test_profiles_round_trip_through_json(tmp_path):
    profile = GPUProfile("mine", 2e12, 3e14, 4e10, 6e-6)
    assert load_profile(str(save_profile(profile, tmp_path / "p.json", measured_by="test"))) == profile
    fused = replace(profile, fused_grouped_gemm=True)
    assert load_profile(str(save_profile(fused, tmp_path / "f.json"))) == fused
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**profile.as_dict(), "fused_grouped_gemm": "yes"}))
    with pytest.raises(TiermoeError, match="fused_grouped_gemm.*true or false"):
        load_profile(str(bad))


def test_model_costs_read_back_records_from_before_one_forward_per_step():
    costs = small_costs(grouped_gemm=True, gpu_call=OpCount(40, 27))
    assert ModelCosts.from_dict(json.loads(json.dumps(costs.as_dict()))) == costs
    old = {("per_sequence" if k == "per_forward" else "sequence_bytes" if k == "forward_bytes" else k): v
           for k, v in small_costs().as_dict().items() if k not in ("gpu_call", "grouped_gemm")}
    assert ModelCosts.from_dict(old) == small_costs()


def test_bench_placement_estimates_without_cuda_and_labels_it(model_dir, dataset, tmp_path):
    out, plot, md = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "r.md"
    result = cli("bench", "placement", "--model", str(model_dir), "--dataset", str(dataset), "--num-prompts", "6",
                 "--calibration-prompts", "6", "--output-len", "8", "--heldout-fraction", "0.5", "--ratios", "0,0.5,1",
                 "--concurrency", "4", "--repeats", "1", "--prefill-threshold", "16", "--max-prompt-tokens", "120",
                 "--out", str(out), "--plot", str(plot), "--markdown", str(md))
    assert result.returncode == 0, result.stderr
    assert "[placement]" in result.stderr  # progress
    data = json.loads(out.read_text())
    assert data["mode"] == "estimated" and data["estimated"] and "ESTIMATE" in data["label"]
    assert len(data["cells"]) == 3 * 8 and all(c["estimated"] for c in data["cells"])
    by = {(c["strategy"], c["ratio"]): c for c in data["cells"]}
    assert all(by[(s, 1.0)]["hit_rate"] == 1.0 for s in data["strategies"])
    static = [s for s in data["strategies"] if s not in ("dynamic", "adaptive")]
    assert all(by[(s, 0.0)]["hit_rate"] == 0.0 for s in static)
    assert by[("dynamic", 0.0)]["hit_rate"] > 0 and by[("dynamic", 0.0)]["expert_bytes_copied"] > 0  # layerwise
    # adaptive serves prompts with the same layerwise prefill: at 0% (nothing to place) it is dynamic's cell
    assert by[("adaptive", 0.0)]["hit_rate"] == by[("dynamic", 0.0)]["hit_rate"]
    assert by[("adaptive", 0.0)]["output_tokens_per_s"] == by[("dynamic", 0.0)]["output_tokens_per_s"]
    assert "Layerwise GPU prefill (--prefill-threshold 16)" in md.read_text()
    assert by[("frequency", 0.5)]["hit_rate"] >= by[("uniform", 0.5)]["hit_rate"] - 0.1
    assert all(c["output_tokens_per_s"] > 0 and c["ttft_seconds"]["mean"] > 0 for c in data["cells"])
    assert "| GPU Expert Ratio | random | uniform |" in result.stdout and "| 50% |" in result.stdout
    assert "ESTIMATE" in result.stdout.split("\n")[0]
    assert md.read_text() == result.stdout.rstrip("\n") + "\n" or md.read_text().strip() == result.stdout.strip()
    assert plot.stat().st_size > 10_000


def test_this_cpu_validates_the_cost_model_against_a_measurement(model_dir, workloads):
    config = PlacementBenchConfig(spec_of("unused"), model=model_dir, ratios=(0.25, 0.5),
                                  strategies=("uniform", "frequency"), gpu_profile="this-cpu", concurrency=4,
                                  repeats=1, prefill_threshold=None)
    messages = []
    result = run_placement_bench(config, messages.append, workloads)
    assert any("in lockstep" in m for m in messages)  # the tiny model's copies fit: timed side by side
    assert [(v["strategy"], v["ratio"]) for v in result.validation] == [
        ("uniform", 0.25), ("uniform", 0.5), ("frequency", 0.25), ("frequency", 0.5)]
    for v in result.validation:
        assert v["measured_seconds"] > 0 and v["estimated_seconds"] > 0
        assert v["within_tolerance"] == (abs(v["relative_error"]) <= 0.15)
    assert result.gpu_profile["name"] == "this-cpu" and result.calibration["host"]["op_seconds"] > 0


def test_without_memory_for_model_copies_the_runs_are_timed_one_after_another(model_dir, workloads, monkeypatch):
    from tiermoe.analysis import placement_lockstep

    monkeypatch.setattr(placement_lockstep, "_available_memory", lambda: 0)
    config = PlacementBenchConfig(spec_of("unused"), model=model_dir, ratios=(0.5,), strategies=("uniform",),
                                  gpu_profile="this-cpu", concurrency=4, repeats=1, prefill_threshold=None,
                                  validation_ratios=(0.5,), validation_strategies=("uniform",))
    messages = []
    result = run_placement_bench(config, messages.append, workloads)
    assert any("one configuration after another" in m for m in messages)
    assert not any("lockstep" in m for m in messages)
    assert [(v["strategy"], v["ratio"]) for v in result.validation] == [("uniform", 0.5)]
    assert result.validation[0]["measured_seconds"] > 0


def test_calibration_and_validation_ratios_must_differ():
    from tiermoe.errors import TiermoeError

    with pytest.raises(TiermoeError, match="must differ"):
        PlacementBenchConfig(spec_of("x"), calibration_ratios=(0.0, 0.5), validation_ratios=(0.5,))


def test_bench_placement_rejects_unknown_strategies(dataset):
    result = cli("bench", "placement", "--dataset", str(dataset), "--strategies", "uniform,magic")
    assert result.returncode == 2 and "magic" in result.stderr


def test_this_cpu_times_the_chosen_strategies_in_alternating_rounds(model_dir, workloads, tmp_path):
    import sys  # the verdict script lives in benchmarks/

    sys.path.insert(0, str(REPO / "benchmarks"))
    from placement_verdict import placement_goals

    config = PlacementBenchConfig(spec_of("unused"), model=model_dir, ratios=(0.5,), strategies=("uniform",),
                                  gpu_profile="this-cpu", concurrency=4, repeats=2, prefill_threshold=None,
                                  validation_ratios=(0.5,), validation_strategies=("uniform",),
                                  timed_strategies=("uniform", "time-balanced", "adaptive"), timed_ratios=(0.5,))
    messages = []
    result = run_placement_bench(config, messages.append, workloads)
    order = [m.split()[2] for m in messages if m.startswith("[placement] timed ")]
    assert order == ["uniform", "time-balanced", "adaptive", "time-balanced", "adaptive", "uniform"]  # rotated
    assert [t["strategy"] for t in result.timed] == ["uniform", "time-balanced", "adaptive"]
    for t in result.timed:
        speeds = t["rounds_output_tokens_per_s"]
        assert len(speeds) == 2 and min(speeds) <= t["median_output_tokens_per_s"] <= max(speeds)
        assert t["spread_output_tokens_per_s"] == pytest.approx(max(speeds) - min(speeds))
    path = tmp_path / "r.json"
    result.write_json(path)
    goals = placement_goals(str(path))
    assert [g[0].split(":")[1].split("(")[0].strip() for g in goals] == [
        "adaptive and time-balanced >= uniform and frequency, measured", "cost-model validation within 15%"]
    with pytest.raises(TiermoeError, match="this-cpu"):
        PlacementBenchConfig(spec_of("unused"), timed_strategies=("uniform",))
