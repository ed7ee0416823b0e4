"""The GPU memory budget reserves what runs beside the weights: the KV cache it sized stays bounded, the cuBLAS
workspaces of the forward threads, and FP8 weights dequantised for a matmul (issue 20).

New names are reached through their modules (`budget.cublas_workspace_bytes`), so on a tree without them each
test fails on its own instead of the whole file failing to import.
"""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny

import tiermoe.experts.fp8_blocks as fp8_blocks
import tiermoe.fit as fit
import tiermoe.model.held_bytes as held_bytes
import tiermoe.placement.budget as budget
from tiermoe.checkpoint.fp8 import FP8Linear
from tiermoe.config import PlacementConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.model.loader import load_hybrid_model
from tiermoe.model.plan_source import placement_target
from tiermoe.placement.planner import PlacementTarget, make_plan
from tiermoe.testing.fp8_write import write_fp8_checkpoint

MIB = 1 << 20


def test_cublas_workspaces_follow_pytorch_sizes_and_the_environment():
    # 32 MiB cuBLAS (Hopper's default, the largest) + 1 MiB cuBLASLt per thread and stream
    assert budget.cublas_workspace_bytes({}) == 33 * MIB
    assert budget.cublas_workspace_bytes({}, hopper=False) == 4096 * 1024 * 2 + 16 * 1024 * 8 + MIB
    assert budget.cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 33 * MIB
    # the deterministic-mode setting: 16 KiB x 8 for cuBLAS, and cuBLASLt is capped at the cuBLAS size
    assert budget.cublas_workspace_bytes({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 2 * 16 * 1024 * 8
    assert budget.cublas_workspace_bytes({"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 36 * MIB
    assert budget.forward_threads(16) == 1  # one forward per step, on the engine thread, whatever runs in it


def _target(**fp8) -> PlacementTarget:
    return PlacementTarget(4, 64, (0, 1, 2, 3), bytes_per_expert=8 * MIB, non_expert_bytes=100 * MIB,
                           kv_bytes_per_token=1024, **fp8)


def test_plan_on_cuda_reserves_the_cublas_workspace_of_the_forward_thread():
    config = PlacementConfig(gpu_memory_gb=2.0, kv_cache_tokens=1024)  # 16 sequences at once by default
    plan = make_plan(config, _target(), gpu_device="cuda:0")  # a number of GB: no CUDA needed to plan
    left = 2048 * MIB - 100 * MIB - 1 * MIB - 33 * MIB  # weights, KV, one forward thread's workspaces
    assert plan.budget["total_gpu_experts"] == left // (8 * MIB)
    on_host = make_plan(config, _target(), gpu_device="cpu")  # the host runs no cuBLAS
    assert on_host.budget["total_gpu_experts"] == (2048 - 100 - 1) // 8
    assert "cuBLAS workspaces 0.03 GiB" in plan.budget["memory"]
    fewer = make_plan(PlacementConfig(gpu_memory_gb=2.0, kv_cache_tokens=1024, max_running=8), _target(),
                      gpu_device="cuda:0")  # one forward per step whatever runs in it: the same workspace
    assert fewer.budget["total_gpu_experts"] == plan.budget["total_gpu_experts"]


def test_plan_reserves_fp8_transients_per_thread_and_one_expert():
    config = PlacementConfig(gpu_memory_gb=2.0, kv_cache_tokens=1024, max_running=3)
    plan = make_plan(config, _target(fp8_dequant_matrix=50 * MIB, fp8_dequant_expert=16 * MIB), gpu_device="cpu")
    left = 2048 * MIB - 100 * MIB - 1 * MIB - (50 * MIB + 16 * MIB)  # the forward thread holds one matrix
    assert plan.budget["total_gpu_experts"] == left // (8 * MIB)
    assert budget.fp8_transient_bytes(4, 50, 16) == 216


def test_dequantising_holds_the_output_and_for_partial_blocks_the_expanded_scales():
    assert fp8_blocks.dequant_bytes((256, 512), (128, 128), torch.bfloat16) == 256 * 512 * 2
    # [576, 7168] (DeepSeek-V3's kv_a_proj): 4.5 blocks high, so the scales are expanded in fp32 in two steps
    expanded = 4 * (5 * 128 * 56 + 576 * 56 * 128)
    assert fp8_blocks.dequant_bytes((576, 7168), (128, 128), torch.bfloat16) == 576 * 7168 * 2 + expanded


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_budget")
    return write_fp8_checkpoint(save_tiny("qwen3_moe", root / "src"), root / "fp8")


def test_the_fp8_transients_come_from_the_checkpoints_own_fp8_weights(fp8_dir):
    target = placement_target(fp8_dir)
    with load_hybrid_model(fp8_dir, None, gpu_device="cpu", progress=False) as hybrid:
        linears = [m for m in hybrid.model.modules() if isinstance(m, FP8Linear)]
        assert linears
        largest = max(fp8_blocks.dequant_bytes(tuple(m.weight.shape), m.block, hybrid.expert_dtype) for m in linears)
        spec, dtype = hybrid.spec, hybrid.expert_dtype
    assert target.fp8_dequant_matrix == largest > 0
    h, i = spec.hidden_size, spec.expert_intermediate_size
    # gate_up [2I, H] filled half by half, each half through dequant_bytes' scale expansion, then down [H, I]
    half = fp8_blocks.dequant_bytes((i, h), (128, 128), dtype)
    assert target.fp8_dequant_expert == 2 * i * h * 2 + half - i * h * 2 + fp8_blocks.dequant_bytes((h, i), (128, 128),
                                                                                                     dtype)
    m = fit.model_bytes(fp8_dir)
    assert (m.fp8_matrix, m.fp8_expert) == (target.fp8_dequant_matrix, target.fp8_dequant_expert)
    report = fit.fit_report(m, gpu_experts=0, max_running=4)
    assert report.fp8_transients == m.fp8_matrix + m.fp8_expert
    assert report.workspaces == 33 * MIB
    assert report.gpu_total == m.non_expert + 8192 * m.kv_bytes_per_token + report.workspaces + report.fp8_transients
    assert "cuBLAS workspaces" in report.describe() and "FP8 transients" in report.describe()
    assert held_bytes.held_from_headers  # the one header read both the planner and `fit` count with


def test_a_plan_sized_by_memory_bounds_the_kv_cache_it_reserved(tiny_dir):
    path = tiny_dir("qwen3_moe")
    config = PlacementConfig(gpu_memory_gb=1.0, kv_cache_tokens=64)
    with LLM(path, gpu_device="cpu", placement=config, dtype=torch.float32, progress=False) as llm:
        assert llm.engine.config.max_total_tokens == 64  # no budget given: the reservation is the bound
        with pytest.raises(TiermoeError, match="max_total_tokens"):
            llm.engine.add(list(range(5, 45)), SamplingParams(max_tokens=40))
        llm.engine.add(list(range(5, 25)), SamplingParams(max_tokens=40))  # 60 tokens: within what was reserved
    with LLM(path, gpu_device="cpu", placement=config, dtype=torch.float32, progress=False,
             max_total_tokens=32) as llm:
        assert llm.engine.config.max_total_tokens == 32  # a budget of its own wins
    assert make_plan(config, placement_target(path)).budget["kv_cache_tokens"] == 64  # kept in plan.json too
