"""The KTransformers-compatible API: masks, arch configs, moving non-expert weights, device maps, env, buffers."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ARCHS, save_tiny

from tiermoe.compat import (
    MOEArchNotSupportedError,
    build_device_map,
    get_moe_arch_config,
    move_non_experts_to_gpu,
    num_gpu_experts_from_env,
)
from tiermoe.engine.llm import LLM
from tiermoe.model.checkpoint import Checkpoint

ROOT = Path(__file__).resolve().parents[1]


def resolve(obj, path: str):
    return functools.reduce(getattr, path.split("."), obj)


def test_toy_example_prints_the_documented_mask():
    out = subprocess.run([sys.executable, str(ROOT / "examples/activation_frequency_toy.py")], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0] == "mask: [[F,T,F,T],[F,F,T,F]]"
    assert "layer 1 expert 2: cuda:0" in out and "layer 0 expert 0: cpu" in out


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_config_paths_resolve_on_the_real_module_tree(arch, tiny_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny_dir(arch)
    config = AutoConfig.from_pretrained(path)
    arch_config = get_moe_arch_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = resolve(model, arch_config.layers_attr)
    assert arch_config.moe_layers
    for i, layer in enumerate(layers):
        block = getattr(layer, arch_config.moe_layer_attr)
        if i not in arch_config.moe_layers:
            assert not hasattr(block, arch_config.experts_attr)
            continue
        router = getattr(block, arch_config.router_attr)
        experts = getattr(block, arch_config.experts_attr)
        assert router.weight.shape[0] == arch_config.expert_num
        for name in arch_config.fused_weight_names:
            assert getattr(experts, name).shape[0] == arch_config.expert_num
        assert experts.gate_up_proj.shape[1:].numel() == 2 * arch_config.intermediate_size * config.hidden_size
        has_shared = any(hasattr(block, a) for a in ("shared_expert", "shared_experts"))
        assert has_shared == arch_config.has_shared_experts
    keys = Checkpoint(path).entries
    layer = arch_config.moe_layers[0]
    if arch != "gpt_oss":  # per-expert names on disk (GPT-OSS ships fused experts)
        block_on_disk = "block_sparse_moe" if arch == "mixtral" else "mlp"
        for name in arch_config.weight_names:
            assert f"model.layers.{layer}.{block_on_disk}.experts.0.{name}.weight" in keys
    assert arch_config.num_experts_per_tok == config.num_experts_per_tok


def test_unsupported_architecture_is_a_clear_error():
    from transformers import AutoConfig

    with pytest.raises(MOEArchNotSupportedError, match="no MoE architecture config for model_type 'llama'"):
        get_moe_arch_config(AutoConfig.for_model("llama"))


def test_move_non_experts_to_meta_leaves_exactly_the_routed_experts(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir("qwen2_moe"))
    experts = {n for n, _ in model.named_parameters() if ".mlp.experts." in n}
    non_expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in experts)
    non_expert_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    moved = move_non_experts_to_gpu(model, device="meta")
    off_meta = {n for n, p in model.named_parameters() if not p.is_meta}
    assert experts and off_meta == experts
    assert moved == non_expert_bytes
    assert all(b.is_meta for b in model.buffers())


def test_move_non_experts_on_a_hybrid_model_keeps_the_tiers(tiny_dir):
    with LLM(tiny_dir("deepseek_v3"), dtype=torch.float32, progress=False) as llm:
        before = llm.hybrid.tier_bytes()
        moved = move_non_experts_to_gpu(llm.hybrid, device="meta")
        assert moved == before.non_expert
        assert all(p.is_meta for p in llm.hybrid.model.parameters())
        assert llm.hybrid.tier_bytes().cpu_experts == before.cpu_experts > 0


def test_device_map_follows_a_plan():
    from tiermoe.placement.plan import PlacementPlan

    plan = PlacementPlan(torch.tensor([[0, -1], [1, -1]]), num_gpus=2)
    assert build_device_map(plan) == {(0, 0): "cuda:0", (0, 1): "cpu", (1, 0): "cuda:1", (1, 1): "cpu"}


def test_a_checkpoint_that_carries_a_gpu_expert_mask_is_placed_by_it(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny("qwen3_moe", tmp_path / "src")  # layer 1 is dense
    model = AutoModelForCausalLM.from_pretrained(path)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, [1, 4]] = True
    mask[1] = True  # KTransformers' convention: dense rows all True
    mask[2, 7] = True
    model.register_buffer("gpu_expert_mask", mask)
    model.save_pretrained(tmp_path / "with-mask")
    with LLM(tmp_path / "with-mask", dtype=torch.float32, progress=False) as llm:
        expected = mask.clone()
        expected[1] = False
        assert torch.equal(llm.placement, expected)


def test_environment_sets_gpu_experts_per_layer(tiny_dir, monkeypatch):
    assert num_gpu_experts_from_env({}) == 0
    assert num_gpu_experts_from_env({"ACCELERATE_KT_NUM_GPU_EXPERTS": "3"}) == 3
    with pytest.raises(Exception, match="not an integer"):
        num_gpu_experts_from_env({"TIERMOE_NUM_GPU_EXPERTS": "many"})
    monkeypatch.setenv("TIERMOE_NUM_GPU_EXPERTS", "2")
    with LLM(tiny_dir("olmoe"), dtype=torch.float32, progress=False) as llm:
        assert llm.placement.sum(dim=1).tolist() == [2, 2]


def test_choose_placement_strategy_example_runs_on_the_bundled_model():
    out = subprocess.run([sys.executable, str(ROOT / "examples/choose_placement_strategy.py"), "--num-prompts", "4",
                          "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line[:1].isdigit()]
    assert len(lines) == 4 and all(line.count("%") == 5 for line in lines)
