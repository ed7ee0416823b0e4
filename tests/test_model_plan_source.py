"""tiermoe.model.plan_source: every form a placement arrives in becomes one PlacementPlan, once, and that plan is
what the loaded model holds (one assignment vector per MoE block)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli

import tiermoe.model.plan_source as plan_source
from tiermoe.arch import detect, load_config
from tiermoe.config import PlacementConfig
from tiermoe.errors import TiermoeError
from tiermoe.layers.hybrid_moe import HybridMoE
from tiermoe.model.loader import load_hybrid_model
from tiermoe.model.plan_source import resolve_plan
from tiermoe.placement.plan import PlacementPlan


@pytest.fixture
def model(tiny_dir):
    path = tiny_dir("deepseek_v3")  # has a dense first layer: its row must stay on the CPU tier
    return path, detect(load_config(path))


def test_every_form_of_placement_becomes_the_same_plan(model, monkeypatch):
    path, spec = model
    monkeypatch.delenv("TIERMOE_NUM_GPU_EXPERTS", raising=False)
    monkeypatch.delenv("ACCELERATE_KT_NUM_GPU_EXPERTS", raising=False)
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    mask[spec.moe_layers, :2] = True  # what PlacementConfig(num_gpu_experts=2) plans with the uniform strategy
    expected = torch.where(mask, 0, -1)
    for given in (mask, mask.int(), PlacementPlan.from_mask(mask), PlacementConfig(num_gpu_experts=2)):
        plan = resolve_plan(given, path, spec)
        assert isinstance(plan, PlacementPlan) and torch.equal(plan.assignment, expected), type(given)
    assert torch.equal(resolve_plan(None, path, spec).assignment, torch.full_like(expected, -1))
    monkeypatch.setenv("ACCELERATE_KT_NUM_GPU_EXPERTS", "2")  # KT's fine-tuning launcher sets this
    assert torch.equal(resolve_plan(None, path, spec).assignment, expected)


def test_a_dense_layer_row_of_a_mask_is_cleared_and_a_plan_for_it_is_refused(model):
    path, spec = model
    mask = torch.ones(spec.num_layers, spec.num_experts, dtype=torch.bool)  # KTransformers marks dense rows True
    assert not resolve_plan(mask, path, spec).mask[0].any()
    with pytest.raises(TiermoeError, match="dense"):
        resolve_plan(PlacementPlan.from_mask(mask), path, spec)


def test_the_plan_must_have_one_gpu_rank_per_process(model):
    path, spec = model
    two = PlacementPlan(torch.full((spec.num_layers, spec.num_experts), -1), num_gpus=2)
    with pytest.raises(TiermoeError, match="2 GPU\\(s\\) but 1 rank"):
        resolve_plan(two, path, spec)
    with pytest.raises(TiermoeError, match="bool mask places experts on one GPU"):
        resolve_plan(torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool), path, spec, num_gpus=2)
    assignment = torch.full((spec.num_layers, spec.num_experts), -1)
    assignment[1:, 0], assignment[1:, 1] = 0, 1
    assert resolve_plan(assignment, path, spec, num_gpus=2).num_gpus == 2


def test_the_loaded_model_holds_the_plan_in_one_assignment_vector_per_block(model):
    path, spec = model
    plan = resolve_plan(PlacementConfig(strategy="random", num_gpu_experts=3), path, spec)
    with load_hybrid_model(path, plan, dtype=torch.float32, progress=False) as hybrid:
        assert torch.equal(hybrid.plan.assignment, plan.assignment)
        assert torch.equal(hybrid.mask, plan.mask)
        for block in hybrid.blocks.values():
            assert isinstance(block, HybridMoE)
            ownership = [name for name, value in vars(block).items()
                         if isinstance(value, torch.Tensor) and value.shape == (spec.num_experts,)]
            assert ownership == ["assignment_E"]  # masks are derived from it, never kept beside it


def test_generate_plans_once_for_the_fit_check_and_the_load(monkeypatch):
    calls = []
    make_plan = plan_source.make_plan
    monkeypatch.setattr(plan_source, "make_plan", lambda *a, **k: calls.append(1) or make_plan(*a, **k))
    result = run_cli("generate", "--prompt", "hi", "--max-tokens", "2", "--num-gpu-experts", "2")  # bundled model
    assert result.returncode == 0, result.stderr
    assert calls == [1]
