"""Placement: KTransformers-compatible masks and strategies, tiermoe's balanced strategy, budgets, plans."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermoe.config import PlacementConfig
from tiermoe.errors import TiermoeError
from tiermoe.placement.budget import MemoryBudget, total_gpu_experts
from tiermoe.placement.global_topk import generate_gpu_experts_masks
from tiermoe.placement.metrics import cpu_bytes_per_pass, hit_rate
from tiermoe.placement.partition import load_per_gpu, split_across_gpus
from tiermoe.placement.plan import PlacementPlan
from tiermoe.placement.planner import PlacementTarget, make_plan
from tiermoe.placement.strategies import (
    balanced_mask,
    frequency_mask,
    front_loading_mask,
    place,
    random_mask,
    uniform_mask,
)
from tiermoe.stats.io import load_counts

TABLE = torch.tensor([[0.1, 0.5, 0.3, 0.8], [0.2, 0.4, 0.9, 0.1]])
KT_ROWS = torch.tensor([False, False, True, True, True, True])  # L=6, first two layers dense


# --- generate_gpu_experts_masks, with KTransformers' own test cases -------------------------------------------

def test_kt_basic_example():
    mask = generate_gpu_experts_masks(TABLE, 3)
    assert mask.tolist() == [[False, True, False, True], [False, False, True, False]]


@pytest.mark.parametrize("k, expected", [(0, 0), (8, 8), (100, 8), (-5, 0)])
def test_kt_edge_cases_clamp(k, expected):
    assert int(generate_gpu_experts_masks(TABLE, k).sum()) == expected


def test_output_is_bool_on_cpu_with_the_input_shape():
    mask = generate_gpu_experts_masks(torch.rand(10, 64, dtype=torch.float16), 50)
    assert mask.shape == (10, 64) and mask.dtype == torch.bool and mask.device.type == "cpu"
    assert int(mask.sum()) == 50


def test_ties_go_to_lower_layer_then_lower_expert():
    assert generate_gpu_experts_masks(torch.ones(2, 4), 3).tolist() == [[True, True, True, False], [False] * 4]
    assert generate_gpu_experts_masks(torch.ones(1, 10), 4)[0].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_nan_counts_as_zero_and_non_contiguous_and_integer_input_work():
    table = torch.tensor([[float("nan"), 0.5], [0.2, 0.1]])
    assert generate_gpu_experts_masks(table, 2).tolist() == [[False, True], [True, False]]
    assert generate_gpu_experts_masks(TABLE.T, 2).shape == (4, 2)
    assert generate_gpu_experts_masks(torch.tensor([[3, 1], [2, 9]]), 2).tolist() == [[True, False], [False, True]]


def test_repeated_calls_agree():
    table = torch.rand(20, 128, generator=torch.Generator().manual_seed(0))
    assert torch.equal(generate_gpu_experts_masks(table, 100), generate_gpu_experts_masks(table, 100))


# --- compatible strategies ------------------------------------------------------------------------------------

def test_kt_uniform_and_front_loading_examples():
    assert uniform_mask(KT_ROWS, 4, 7).sum(dim=1).tolist() == [0, 0, 2, 2, 2, 1]
    assert front_loading_mask(KT_ROWS, 4, 7).sum(dim=1).tolist() == [0, 0, 4, 3, 0, 0]
    assert uniform_mask(KT_ROWS, 4, 7)[2].tolist() == [True, True, False, False]  # experts 0..c-1


def test_random_is_seeded_and_stays_in_moe_layers():
    a, b = random_mask(KT_ROWS, 4, 7), random_mask(KT_ROWS, 4, 7)
    assert torch.equal(a, b) and int(a.sum()) == 7 and not a[:2].any()
    assert not torch.equal(a, random_mask(KT_ROWS, 4, 7, seed=1))


@pytest.mark.parametrize("ratio, expected", [(0.0, 0), (1.0, 16), (0.5, 8), (0.3, 4)])
def test_ratio_budget(ratio, expected):
    assert total_gpu_experts(4, 4, ratio=ratio) == expected


def test_per_layer_count_above_e_gives_every_expert():
    total = total_gpu_experts(4, 4, num_gpu_experts=9)
    assert total == 16
    assert uniform_mask(KT_ROWS, 4, total).sum(dim=1).tolist() == [0, 0, 4, 4, 4, 4]


def test_ratio_wins_over_count_with_a_warning():
    with pytest.warns(UserWarning, match="ratio wins"):
        assert total_gpu_experts(4, 4, num_gpu_experts=1, ratio=0.5) == 8


def test_frequency_without_statistics_is_an_error():
    with pytest.raises(TiermoeError, match="needs activation statistics"):
        place("frequency", KT_ROWS, 4, 3)


def test_frequency_never_picks_dense_layers_even_on_ties():
    counts = torch.zeros(6, 4)
    counts[3, 1] = 5
    mask = frequency_mask(counts, KT_ROWS, 6)
    assert not mask[:2].any() and mask[3, 1] and int(mask.sum()) == 6


# --- properties of every strategy -----------------------------------------------------------------------------

layouts = st.tuples(st.integers(1, 6), st.integers(1, 9), st.integers(0, 3)).filter(lambda t: t[2] < t[0])


@settings(max_examples=120, deadline=None)
@given(layouts, st.integers(-3, 80), st.sampled_from(["uniform", "front-loading", "random", "frequency", "balanced"]),
       st.integers(0, 2**31 - 1))
def test_every_strategy_respects_budget_and_dense_rows(layout, total, strategy, seed):
    num_layers, num_experts, dense = layout
    rows = torch.arange(num_layers) >= dense
    counts = torch.randint(0, 50, (num_layers, num_experts), generator=torch.Generator().manual_seed(seed)).float()
    mask = place(strategy, rows, num_experts, total, counts, seed=seed)
    assert mask.shape == (num_layers, num_experts) and mask.dtype == torch.bool
    assert not mask[~rows].any()
    capacity = int(rows.sum()) * num_experts
    assert int(mask.sum()) == min(max(total, 0), capacity)
    if strategy == "frequency":
        chosen, unchosen = counts[mask], counts[~mask & rows[:, None]]
        assert chosen.numel() == 0 or unchosen.numel() == 0 or chosen.min() >= unchosen.max()
    if strategy == "balanced" and total >= int(rows.sum()):
        assert bool(mask[rows].any(dim=1).all())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(2, 8), st.integers(0, 40), st.integers(0, 2**31 - 1))
def test_the_top_k_of_the_counts_is_the_hit_rate_oracle(num_layers, num_experts, k, seed):
    counts = torch.rand(num_layers, num_experts, generator=torch.Generator().manual_seed(seed))
    best = hit_rate(generate_gpu_experts_masks(counts, k), counts)
    for trial in range(5):
        other = random_mask(torch.ones(num_layers, dtype=torch.bool), num_experts, k, seed=seed + trial)
        assert hit_rate(other, counts) <= best + 1e-12


def test_balanced_covers_layers_and_spreads_flat_statistics():
    rows = torch.ones(8, dtype=torch.bool)
    flat = balanced_mask(torch.ones(8, 16), rows, 20)
    assert flat.sum(dim=1).max() - flat.sum(dim=1).min() <= 1
    skewed = torch.zeros(8, 16)
    skewed[0] = torch.arange(16, 0, -1) * 100.0
    skewed[1:, 0] = 1
    assert frequency_mask(skewed, rows, 8).sum(dim=1).tolist() == [8, 0, 0, 0, 0, 0, 0, 0]
    assert balanced_mask(skewed, rows, 8).sum(dim=1).tolist() == [1] * 8


def _zipf_layers(gen, num_layers, num_experts):
    alpha = 0.3 + 0.4 * torch.rand(num_layers, generator=gen)  # per-layer Gini of about 0.1-0.25, as real models
    ranks = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_layers)]).double() + 1
    p = ranks ** (-alpha[:, None])
    return p / p.sum(dim=1, keepdim=True)


def _sample_counts(p, pairs, gen):
    return torch.stack([torch.bincount(torch.multinomial(row, pairs, replacement=True, generator=gen),
                                       minlength=p.shape[1]) for row in p]).double()


def test_balanced_matches_frequency_on_held_out_samples_over_many_seeds():
    rows = torch.ones(8, dtype=torch.bool)
    diffs = []
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        p = _zipf_layers(gen, 8, 32)
        calibration, held_out = _sample_counts(p, 800, gen), _sample_counts(p, 20000, gen)
        for ratio in (0.05, 0.1, 0.25, 0.5):
            total = int(ratio * 8 * 32)
            diffs.append(hit_rate(balanced_mask(calibration, rows, total), held_out)
                         - hit_rate(frequency_mask(calibration, rows, total), held_out))
    assert sum(diffs) / len(diffs) >= -5e-4


# --- GPU splits -------------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.sampled_from(["balanced", "layers", "round-robin"]), st.integers(0, 2**31 - 1))
def test_splits_cover_the_mask_once_within_memory_shares(num_gpus, method, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(6, 16, generator=gen) < 0.6
    counts = torch.rand(6, 16, generator=gen) * 100
    assignment = split_across_gpus(mask, num_gpus, method, counts)
    assert torch.equal(assignment >= 0, mask)
    n = int(mask.sum())
    per_gpu = [int((assignment == r).sum()) for r in range(num_gpus)]
    assert sum(per_gpu) == n and max(per_gpu) <= math.ceil(n / num_gpus) + (0 if method != "layers" else 1)
    if method == "layers":
        ranks = assignment[mask].tolist()  # layer-major
        assert ranks == sorted(ranks)


def test_balanced_split_evens_the_load_within_ten_percent():
    gen = torch.Generator().manual_seed(0)
    counts = torch.rand(8, 64, generator=gen) ** 3 * 1000
    mask = generate_gpu_experts_masks(counts, 200)
    loads = load_per_gpu(split_across_gpus(mask, 4, "balanced", counts), 4, counts)
    assert max(loads) <= 1.10 * min(loads)
    layered = load_per_gpu(split_across_gpus(mask, 4, "layers", counts), 4, counts)
    assert max(layered) / min(layered) > max(loads) / min(loads)


# --- plans, statistics files, memory ----------------------------------------------------------------------------

def test_plan_round_trips_and_rank_masks_partition_it(tmp_path):
    config = PlacementConfig(strategy="random", num_gpu_experts=2, num_gpus=2, gpu_split="round-robin")
    plan = make_plan(config, PlacementTarget(6, 4, (2, 3, 4, 5), model_type="qwen3_moe"))
    loaded = PlacementPlan.load(plan.save(tmp_path / "plan.json"))
    assert torch.equal(loaded.assignment, plan.assignment) and loaded.num_gpus == 2
    assert loaded.strategy == "random" and loaded.budget["total_gpu_experts"] == 8
    assert torch.equal(loaded.rank_mask(0) | loaded.rank_mask(1), loaded.mask)
    assert not (loaded.rank_mask(0) & loaded.rank_mask(1)).any()
    assert json.loads((tmp_path / "plan.json").read_text())["format"] == "tiermoe-placement-plan"


def test_malformed_plans_are_refused(tmp_path):
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TiermoeError, match="not a tiermoe plan"):
        PlacementPlan.load(tmp_path / "bad.json")
    with pytest.raises(TiermoeError, match="-1 \\(CPU\\) or a GPU rank"):
        PlacementPlan(torch.tensor([[0, 3]]), num_gpus=2)


def test_statistics_files_in_every_format(tmp_path):
    logical = torch.randint(0, 9, (5, 6, 4), dtype=torch.int32)
    torch.save({"rank": 0, "logical_count": logical, "average_utilization_rate_over_window": None},
               tmp_path / "sglang.pt")
    assert torch.equal(load_counts(tmp_path / "sglang.pt", 6, 4), logical.sum(0).double())
    torch.save({"activation_counts": logical[0], "num_layers": 6}, tmp_path / "kt.pt")
    assert torch.equal(load_counts(tmp_path / "kt.pt", 6, 4), logical[0].double())
    torch.save(logical[1].float(), tmp_path / "plain.pt")
    assert load_counts(tmp_path / "plain.pt", 6, 4).shape == (6, 4)


def test_statistics_of_another_model_are_refused(tmp_path):
    torch.save({"logical_count": torch.zeros(1, 5, 4)}, tmp_path / "s.pt")
    with pytest.raises(TiermoeError, match=r"shape \[1, 5, 4\]; expected \[buf, 6, 4\] or \[6, 4\]"):
        load_counts(tmp_path / "s.pt", 6, 4)
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    with pytest.raises(TiermoeError, match="not a statistics file"):
        load_counts(tmp_path / "junk.pt", 6, 4)


def test_memory_budget_counts_real_bytes():
    target = PlacementTarget(4, 8, (0, 1, 2, 3), bytes_per_expert=1 << 20, non_expert_bytes=3 << 20,
                             kv_bytes_per_token=1024)
    # the GPU tier on the host: no cuBLAS workspaces (tests/test_fit_budget_extras.py counts those)
    plan = make_plan(PlacementConfig(gpu_memory_gb=10 / 1024, kv_cache_tokens=1024), target, gpu_device="cpu")
    assert plan.budget["total_gpu_experts"] == 10 - 3 - 1  # MiB: 10 total, 3 weights, 1 KV cache
    budget = MemoryBudget(100, 30, 10, 5, 5)
    assert budget.experts == 50 and budget.experts_that_fit(7, 100) == 7


def test_cpu_bytes_per_pass_counts_distinct_cpu_experts():
    passes = torch.zeros(2, 1, 4)
    passes[0, 0, :2] = 3  # pass 0 touches experts 0, 1
    passes[1, 0, 1:] = 1  # pass 1 touches experts 1, 2, 3
    mask = torch.tensor([[False, True, False, False]])
    assert cpu_bytes_per_pass(mask, passes, 10) == (1 + 2) / 2 * 10


def test_bad_config_values_are_refused():
    with pytest.raises(TiermoeError, match="strategy"):
        PlacementConfig(strategy="best")
    with pytest.raises(TiermoeError, match="ratio"):
        PlacementConfig(gpu_experts_ratio=1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert PlacementConfig(strategy="front_loading").strategy == "front-loading"
