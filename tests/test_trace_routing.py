"""Routing from a trace (`bench placement --routing-trace`): the model's routers pick exactly the trace's experts
per (request, position, layer), every other row keeps the model's own routing, and the placement table is built
on that routing."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli, save_tiny
from transformers import AutoModelForCausalLM

from tiermoe.analysis.trace_workload import RoutingTraceSpec, spread_layers, trace_workloads
from tiermoe.analysis.workload_runs import record_trace
from tiermoe.engine.llm import LLM
from tiermoe.errors import TiermoeError
from tiermoe.experts.kernels import supported_isa
from tiermoe.layers.fused_decode_layer import FusedDecodeLayer
from tiermoe.layers.trace_routing import TraceExperts, TraceRouter, install_trace_routing, remove_trace_routing
from tiermoe.stats.recording import PassInfo
from tiermoe.stats.trace_csv import write_trace_csv
from tiermoe.testing.tiny_configs import tiny_config

E, K = 8, 2
LENGTHS, PROMPTS = (6, 5, 7, 4), (3, 0, 2, 1)  # tokens and prefill tokens of trace requests 10, 11, 12, 13


class Engine:
    """An engine as TraceRouting sees one: something its sequence ids belong to."""


def make_trace(hot: dict[int, tuple[int, int]] | None = None, seed: int = 0) -> dict:
    """4 layers, all MoE; random distinct ids per (token, layer), or each layer's `hot` pair."""
    gen = torch.Generator().manual_seed(seed)
    req, pos, pre = [], [], []
    for r, (n, p) in enumerate(zip(LENGTHS, PROMPTS)):
        req += [10 + r] * n
        pos += range(n)
        pre += [i < p for i in range(n)]
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(len(req) * 4)]).view(len(req), 4, K)
    for layer, pair in (hot or {}).items():
        ids[:, layer] = torch.tensor(pair)
    return {"num_layers": 4, "num_experts": E, "moe_layers": [0, 1, 2, 3], "topk_ids": ids.to(torch.int16),
            "token_request": torch.tensor(req, dtype=torch.int32), "token_position": torch.tensor(pos, dtype=torch.int32),
            "token_is_prefill": torch.tensor(pre), "token_pass": torch.arange(len(req), dtype=torch.int32)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("trace-routing") / "m")  # MoE layers 0 and 2, top-2


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, progress=False) as loaded:
        yield loaded


def test_the_routers_pick_the_trace_experts_exactly(llm, tmp_path):
    trace = make_trace()
    path = write_trace_csv(trace, tmp_path / "t.csv")
    traced = trace_workloads(RoutingTraceSpec(str(path)), llm.hybrid.spec, 256, 8, 8)
    assert traced.layers == (0, 3) and traced.heldout.trace_requests == (11, 13)  # odd requests served
    assert traced.calibration.trace_requests == (10, 12)
    assert traced.heldout.output_lens == (5, 4) and [len(p) for p in traced.heldout.prompt_ids] == [1, 1]
    assert_recorded_routing_is_the_trace(llm, trace, traced, (traced.heldout, traced.calibration))


def assert_recorded_routing_is_the_trace(llm, trace: dict, traced, workloads) -> None:
    install_trace_routing(llm.hybrid, traced.routing)
    try:
        for workload in workloads:
            got = record_trace(llm, workload, 2, 512)
            served = torch.tensor(workload.trace_requests)[got["token_request"].long()]
            for n in range(len(served)):
                source = ((trace["token_request"] == served[n]) & (trace["token_position"] == got["token_position"][n]))
                expected = trace["topk_ids"][source.nonzero().item(), [0, 3]]
                assert torch.equal(got["topk_ids"][n].long(), expected.long()), n
            lengths = [LENGTHS[r - 10] for r in workload.trace_requests]
            assert len(served) == sum(lengths)  # every token of every served request, once
    finally:
        remove_trace_routing(llm.hybrid)


def test_a_family_that_keeps_its_own_block_forward_routes_by_the_trace_too(tmp_path):
    """A discovered family (MiniMax-M2: the model's own block routes, then calls its experts module): the trace's
    ids reach the tiers through that call (TraceExperts); removing the trace puts the experts module back."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("minimax_m2", initializer_range=0.1), dtype=torch.float32)
    model.save_pretrained(tmp_path / "m", save_original_format=False)  # 2 MoE layers, 8 experts, top-2
    trace = make_trace()
    with LLM(tmp_path / "m", progress=False) as llm:
        assert llm.hybrid.spec.block_forward == "model"
        traced = trace_workloads(RoutingTraceSpec(str(write_trace_csv(trace, tmp_path / "t.csv"))),
                                 llm.hybrid.spec, 256, 8, 8)
        assert_recorded_routing_is_the_trace(llm, trace, traced, (traced.heldout,))
        assert not any(isinstance(module, TraceExperts) for module in llm.hybrid.model.modules())


@pytest.mark.skipif(supported_isa() is None, reason="the kernel library is unavailable")
def test_a_fused_decode_layer_routes_by_the_trace_too(tmp_path):
    """A CPU-only bf16 Qwen3-MoE run computes each decode step of a layer in one native call, router included
    (FusedDecodeLayer); with the trace's router in place the step must ask it (a real-size Qwen3 run recorded the
    model's own routing before: hit rates of 4% where the trace gives 24%)."""
    path = save_tiny("qwen3_moe", tmp_path / "m", sizes={"moe_intermediate_size": 64})  # sizes the kernels take
    trace = make_trace()
    with LLM(path, dtype=torch.bfloat16, progress=False) as llm:
        assert any(isinstance(layer, FusedDecodeLayer) for layer in llm.hybrid.model.model.layers)
        traced = trace_workloads(RoutingTraceSpec(str(write_trace_csv(trace, tmp_path / "t.csv"))),
                                 llm.hybrid.spec, 256, 8, 8)
        assert_recorded_routing_is_the_trace(llm, trace, traced, (traced.heldout,))


def test_rows_the_trace_does_not_hold_keep_the_models_routing(llm):
    trace = make_trace()
    from tiermoe.layers.trace_routing import TraceRouting

    routing = TraceRouting(trace["topk_ids"][:, [0, 3]], trace["token_request"], trace["token_position"], [0, 2])
    install_trace_routing(llm.hybrid, routing)
    try:
        router = llm.hybrid.blocks[2]._modules[llm.hybrid.spec.router_attr]
        assert isinstance(router, TraceRouter)
        x = torch.randn(3, llm.hybrid.spec.hidden_size)
        own = router.original(x)
        engine = Engine()
        routing.assign(engine, {0: 12})
        # sequence 0 at positions 5, 6 (request 12 has 7 tokens) and 7 (past its end); sequence 1 unknown
        routing.begin_pass(PassInfo((0, 1), (3, 0), (5, 0), (False, False)), engine)
        _, weights, ids = router(x[:3])
        routing.end_pass()
        rows = (trace["token_request"] == 12).nonzero().flatten()
        assert torch.equal(ids[:2], trace["topk_ids"][rows[5:7], 3].long()) and torch.equal(ids[2], own[2][2])
        assert torch.allclose(weights[:2], torch.full((2, K), 0.5)) and torch.equal(weights[2], own[1][2])
        routing.begin_pass(PassInfo((0,), (3,), (5,), (False,)), Engine())  # another engine: its own routing
        assert torch.equal(router(x)[2], own[2])
        routing.end_pass()
        assert torch.equal(router(x)[2], own[2])  # outside a pass
    finally:
        remove_trace_routing(llm.hybrid)
    assert not isinstance(llm.hybrid.blocks[2]._modules[llm.hybrid.spec.router_attr], TraceRouter)


def test_a_trace_that_does_not_fit_the_model_is_a_one_line_error(llm, tmp_path):
    trace = make_trace()
    with pytest.raises(TiermoeError, match="top-k 3"):
        wide = dict(trace, topk_ids=torch.randperm(E).repeat(len(trace["token_request"]), 4, 1)[..., :3])
        install_trace_routing(llm.hybrid, trace_workloads(RoutingTraceSpec(str(write_trace_csv(
            wide, tmp_path / "w.csv"))), llm.hybrid.spec, 256, 8, 8).routing)
    path = str(write_trace_csv(trace, tmp_path / "t.csv"))
    with pytest.raises(TiermoeError, match="2 of the trace's MoE layers"):
        trace_workloads(RoutingTraceSpec(path, layers=(0, 1, 2)), llm.hybrid.spec, 256, 8, 8)
    one = {k: (v[:LENGTHS[0]] if k.startswith("token") or k == "topk_ids" else v) for k, v in trace.items()}
    with pytest.raises(TiermoeError, match="--routing-calibration"):
        trace_workloads(RoutingTraceSpec(str(write_trace_csv(one, tmp_path / "o.csv"))), llm.hybrid.spec, 256, 8, 8)
    assert spread_layers(list(range(1, 27)), 4) == (1, 9, 18, 26)


def test_bench_placement_builds_its_table_on_the_trace_routing(model_dir, tmp_path):
    trace = make_trace(hot={0: (6, 7), 3: (4, 5)})  # every token routes to one pair per replayed layer
    path = write_trace_csv(trace, tmp_path / "hot.csv")
    out = tmp_path / "r.json"
    result = run_cli("bench", "placement", "--model", str(model_dir), "--routing-trace", str(path), "--ratios",
                     "0.25", "--strategies", "uniform,frequency,adaptive", "--concurrency", "2", "--repeats", "1",
                     "--prefill-threshold", "0", "--out", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    by = {c["strategy"]: c for c in data["cells"]}
    assert by["frequency"]["hit_rate"] == 1.0 and by["uniform"]["hit_rate"] < 0.5  # the trace's routing, not the model's
    routing = data["setup"]["routing"]
    assert routing["source"] == "trace" and routing["trace_layers"] == [0, 3] and routing["rows_from_trace"] > 0
    assert data["setup"]["dataset"] == "routing trace hot.csv"  # what the plot's title names
    assert "Routing from the trace" in result.stdout


@pytest.mark.parametrize("argv,words", [((), "--dataset"), (("--dataset", "x.jsonl", "--routing-trace", "t.csv"),
                                                             "one of the two")])
def test_bench_placement_takes_a_dataset_or_a_routing_trace(argv, words):
    result = run_cli("bench", "placement", *argv)
    assert result.returncode == 2 and words in result.stderr.strip().splitlines()[-1]


def test_make_model_takes_the_trace_top_k(tmp_path):
    result = run_cli("make-model", "--arch", "qwen3_moe", "--top-k", "3", "--no-tokenizer", "--out", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_experts_per_tok"] == 3
