"""Recorder files in SGLang's layouts (srt/eplb/expert_distribution.py, SGLang-kt's GPU masks): every mode's file
has SGLang's keys and dtypes and loads with weights_only=True; files built the way SGLang builds them (redundant
physical experts included) are read by `tiermoe stats`, `tiermoe place` and `tiermoe bench dynamic`; tiermoe's
earlier dumps still load."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import run_cli

from tiermoe.analysis.trace_replay import trace_passes
from tiermoe.arch import detect, load_config
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.stats.io import gpu_masks_path, load_counts, load_stats, write_dump
from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.recorders import make_recorder

STAT_KEYS = {"rank", "logical_count", "average_utilization_rate_over_window"}
DETAIL_KEYS = {"records", "last_physical_to_logical_map"}
PASS_RECORD_KEYS = {"forward_pass_id", "rank", "gatherer_key", "global_physical_count"}
TOKEN_RECORD_KEYS = PASS_RECORD_KEYS | {"input_ids", "positions", "extend_seq_lens", "forward_mode",
                                        "topk_ids_of_layer", "misc_objects"}
PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [30, 31, 32]]


@pytest.fixture(scope="module")
def recorded(tiny_dir, tmp_path_factory):
    """For each mode: (in-memory dump, files written) of one run of the tiny qwen3_moe (3 layers, 8 experts, top-2,
    layer 1 dense), GPU-tier snapshots on, a circular buffer of 64 passes."""
    path = tiny_dir("qwen3_moe")
    shape = ModelShape.of(detect(load_config(path)))
    out = {}
    for mode in ("stat", "per_pass", "per_token"):
        recorder = make_recorder(mode, shape, 64, record_gpu_masks=True)
        with LLM(path, dtype=torch.float32, recorder=recorder, progress=False, max_running=2) as llm:
            llm.generate(PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True))
        folder = tmp_path_factory.mktemp(mode)
        dump = recorder.dump()
        suffix = "_0" if mode != "stat" else ""
        files = write_dump(dump, folder / f"expert_distribution_recorder_1764640000.5{suffix}.pt")
        out[mode] = (dump, files, path, shape)
    return out


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_stat_file_is_sglangs(recorded):
    dump, (counts_path, masks_path), _, shape = recorded["stat"]
    data = load(counts_path)
    assert STAT_KEYS <= set(data) and data["rank"] == 0 and data["average_utilization_rate_over_window"] is None
    logical = data["logical_count"]
    assert logical.dtype == torch.int32 and logical.shape == (64, shape.num_layers, shape.num_experts)
    assert int(logical[:, 1].sum()) == 0 and int(logical[dump["num_passes"]:].sum()) == 0  # dense layer, empty slots
    # SGLang-kt's separate mask file, same time stamp, lined up slot for slot (its compute_gpu_hit_ratio asserts it)
    assert masks_path.name == "gpu_expert_distribution_1764640000.5.pt"
    masks = load(masks_path)
    assert "gpu_expert_masks" in masks and "logical_count" not in masks
    assert masks["gpu_expert_masks"].dtype == torch.bool and masks["gpu_expert_masks"].shape == logical.shape
    stats = load_stats(counts_path)
    assert torch.equal(stats.counts_LE, logical.sum(dim=0).double()) and stats.has_split
    assert stats.gpu_masks_PLE is not None and stats.gpu_masks_PLE.shape[0] == dump["num_passes"]  # found beside


def test_per_pass_file_is_sglangs(recorded):
    dump, (counts_path, masks_path), _, shape = recorded["per_pass"]
    assert re.fullmatch(r"expert_distribution_recorder_[\d.]+_0\.pt", counts_path.name)
    assert masks_path.name == "gpu_expert_distribution_1764640000.5.pt"  # no rank suffix, as SGLang-kt
    data = load(counts_path)
    assert DETAIL_KEYS <= set(data) and len(data["records"]) == dump["num_passes"] > 1
    assert torch.equal(data["last_physical_to_logical_map"], torch.arange(shape.num_experts).repeat(shape.num_layers, 1))
    for i, record in enumerate(data["records"]):
        assert PASS_RECORD_KEYS <= set(record) and record["gatherer_key"] == "primary" and record["rank"] == 0
        count = record["global_physical_count"]
        assert count.dtype == torch.int32 and count.shape == (shape.num_layers, shape.num_experts)
        assert torch.equal(count.long(), dump["logical_count"][i]) and record["forward_pass_id"] == i
    stats = load_stats(counts_path, shape.num_layers, shape.num_experts)
    assert torch.equal(stats.counts_LE, dump["logical_count"].sum(dim=0).double()) and stats.kinds == ("tiermoe per_pass",)
    assert torch.equal(load_counts(counts_path, shape.num_layers, shape.num_experts), stats.counts_LE)


def test_per_token_file_is_sglangs(recorded):
    dump, (counts_path, _), _, shape = recorded["per_token"]
    data = load(counts_path)
    assert DETAIL_KEYS <= set(data) and len(data["records"]) == dump["num_passes"]
    modes = []
    for record in data["records"]:
        assert TOKEN_RECORD_KEYS <= set(record)
        topk = record["topk_ids_of_layer"]
        T = len(record["positions"])
        assert topk.dtype == torch.int32 and topk.shape == (shape.num_layers, T, 8) and len(record["input_ids"]) == T
        assert all(0 <= token < 256 for token in record["input_ids"])  # the ids the engine fed
        assert (topk[1] == -1).all() and (topk[:, :, shape.top_k:] == -1).all()  # dense layer, columns past top-k
        assert (topk[list(shape.moe_layers), :, :shape.top_k] >= 0).all()
        valid = topk >= 0
        counted = torch.zeros(shape.num_layers, shape.num_experts, dtype=torch.int32).scatter_add_(
            1, topk.masked_fill(~valid, 0).flatten(1).long(), valid.flatten(1).int())
        assert torch.equal(record["global_physical_count"], counted)
        lens = record["extend_seq_lens"]
        assert (lens is None) == (record["forward_mode"] == 2) and (lens is None or sum(lens) == T)
        modes.append(record["forward_mode"])
    assert modes[0] == 1 and 2 in modes  # an extend pass first, decode passes later
    assert data["records"][0]["input_ids"] == PROMPTS[0] + PROMPTS[1]  # the first pass: two prompts side by side
    # the file and the in-memory trace replay the same
    replayed, expected = trace_passes(data), trace_passes(dump)
    assert torch.equal(replayed.counts_PME, expected.counts_PME) and torch.equal(replayed.prefill_P, expected.prefill_P)
    stats = load_stats(counts_path)
    assert torch.equal(stats.prefill_LE, load_stats_of(dump).prefill_LE)


def load_stats_of(dump):
    from tiermoe.stats.expert_stats import stats_from_data

    return stats_from_data(dump, "memory")


def test_every_mode_loads_with_weights_only_and_earlier_dumps_still_load(recorded, tmp_path):
    for mode, (dump, files, _, shape) in recorded.items():
        for path in files:
            load(path)  # raises on anything weights_only refuses
        old = tmp_path / f"old_{mode}.pt"  # tiermoe's earlier layout: the dump dict as it was saved
        torch.save(dump, old)
        assert torch.equal(load_stats(old).counts_LE, load_stats(files[0]).counts_LE)
    old_stat = {"format": "tiermoe-expert-distribution", "mode": "stat", "rank": 0, "num_layers": 3, "num_experts": 8,
                "logical_count": torch.ones(1, 3, 8, dtype=torch.int64), "moe_layers": [0, 2]}
    torch.save(old_stat, tmp_path / "old_int64.pt")
    assert float(load_counts(tmp_path / "old_int64.pt", 3, 8).sum()) == 24


# ---------------------------------------------------------------- files written the way SGLang writes them

L, E, K = 3, 8, 2
PHYS = 10  # two redundant physical slots: 8 -> expert 1, 9 -> expert 6 (SGLang's EPLB replicas)
MAP = torch.cat([torch.arange(E), torch.tensor([1, 6])]).repeat(L, 1)


def sglang_topk(T: int, seed: int) -> torch.Tensor:
    """[L, T, 8] int32 as SGLang's _DetailSinglePassGatherer: -1 filled, top-k columns set on MoE layers 0, 2."""
    g = torch.Generator().manual_seed(seed)
    topk = torch.full((L, T, 8), -1, dtype=torch.int32)
    for layer in (0, 2):
        topk[layer, :, :K] = torch.stack([torch.randperm(PHYS, generator=g)[:K] for _ in range(T)]).int()
    return topk


def physical_count(topk: torch.Tensor) -> torch.Tensor:
    valid = topk != -1
    return torch.zeros(L, PHYS, dtype=torch.int32).scatter_add_(
        1, topk.masked_fill(~valid, 0).reshape(L, -1).long(), valid.reshape(L, -1).int())


def logical(phys_LX: torch.Tensor) -> torch.Tensor:
    return torch.zeros(L, E, dtype=torch.int64).scatter_add_(1, MAP, phys_LX.long())


@pytest.fixture
def sglang_per_token(tmp_path):
    passes = [(1, [4, 3], sglang_topk(7, 0)), (2, None, sglang_topk(2, 1)), (2, None, sglang_topk(2, 2))]
    records = []
    for i, (mode, lens, topk) in enumerate(passes):
        T = topk.shape[1]
        records.append(dict(forward_pass_id=100 + i, rank=0, gatherer_key="primary", input_ids=list(range(T)),
                            positions=list(range(T)) if mode == 1 else [4, 3], extend_seq_lens=lens,
                            forward_mode=mode, topk_ids_of_layer=topk, misc_objects=[],
                            global_physical_count=physical_count(topk)))
    path = tmp_path / "expert_distribution_recorder_1764640000.1_0.pt"
    torch.save({"records": records, "last_physical_to_logical_map": MAP}, path)
    return path, passes


def test_sglang_per_pass_file_feeds_stats_and_place(tmp_path, tiny_dir):
    counts = [physical_count(sglang_topk(5, s)) for s in range(4)]
    records = [dict(forward_pass_id=7 + i, rank=0, gatherer_key="primary", global_physical_count=c)
               for i, c in enumerate(counts)]
    path = tmp_path / "expert_distribution_recorder_1764640000.2_0.pt"
    torch.save({"records": records, "last_physical_to_logical_map": MAP}, path)
    expected = sum(logical(c) for c in counts).double()
    r = run_cli("stats", str(path), "--json")
    assert r.returncode == 0, r.stderr
    stats = load_stats(path)
    assert torch.equal(stats.counts_LE, expected) and stats.kinds == ("sglang per_pass",) and stats.moe_layers == (0, 2)
    assert float(expected.sum()) == 4 * 5 * K * 2  # replicas folded into their logical experts, nothing lost
    model = tiny_dir("qwen3_moe")
    r = run_cli("place", "--model", str(model), "--strategy", "frequency", "--init-expert-location",
                             str(path), "--num-gpu-experts", "2", "--json", "--out", str(tmp_path / "plan.json"))
    assert r.returncode == 0, r.stderr
    top = expected.flatten().sort().values[-4:].sum() / expected.sum()
    assert json.loads(r.stdout)["expected_hit_rate"] == pytest.approx(float(top))


def test_sglang_per_token_file_feeds_stats_and_bench_dynamic(sglang_per_token, tmp_path, tiny_dir):
    path, passes = sglang_per_token
    stats = load_stats(path)
    expected_prefill = logical(physical_count(passes[0][2])).double()
    assert stats.kinds == ("sglang per_token",) and stats.moe_layers == (0, 2) and stats.top_k == K
    assert torch.equal(stats.prefill_LE, expected_prefill)
    assert (stats.num_prefill_tokens, stats.num_decode_tokens) == (7, 4)
    replay = trace_passes(load(path))
    assert replay.num_passes == 3 and replay.prefill_P.tolist() == [True, False, False]
    assert replay.tokens_P.tolist() == [7, 2, 2] and replay.decode_tokens_P.tolist() == [0, 2, 2]
    assert torch.equal(replay.counts_PME[0], logical(physical_count(passes[0][2]))[[0, 2]])
    r = run_cli("bench", "dynamic", "--trace", str(path), "--model", str(tiny_dir("qwen3_moe")),
                             "--ratios", "0.25", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["passes"] == 3


def test_sglang_gpu_mask_file_joins_stats_by_its_time_stamp(sglang_per_token, tmp_path):
    path, _ = sglang_per_token
    assert gpu_masks_path(path).name == "gpu_expert_distribution_1764640000.1.pt"
    masks = torch.zeros(3, L, E, dtype=torch.bool)
    masks[:, 0, :2] = True
    torch.save({"gpu_expert_masks": masks}, gpu_masks_path(path))
    assert torch.equal(load_stats(path).gpu_masks_PLE, masks)
    assert torch.equal(load_stats([path, gpu_masks_path(path)]).gpu_masks_PLE, masks)  # named explicitly: once
