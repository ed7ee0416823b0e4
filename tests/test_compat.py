"""The KTransformers-compatible API: masks, arch configs, moving non-expert weights, device maps, env, buffers."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ARCHS, run_script, save_tiny

from tiermoe.arch import detect, load_config
from tiermoe.checkpoint.safetensors import Checkpoint
from tiermoe.compat import (
    MOEArchNotSupportedError,
    build_device_map,
    get_moe_arch_config,
    move_non_experts_to_gpu,
    num_gpu_experts_from_env,
)
from tiermoe.engine.llm import LLM
from tiermoe.errors import TiermoeError
from tiermoe.model.plan_source import resolve_plan

ROOT = Path(__file__).resolve().parents[1]


def resolve(obj, path: str):
    return functools.reduce(getattr, path.split("."), obj)


def test_toy_example_prints_the_documented_mask():
    done = run_script(ROOT / "examples/activation_frequency_toy.py")
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "mask: [[F,T,F,T],[F,F,T,F]]"
    assert "layer 1 expert 2: cuda:0" in out and "layer 0 expert 0: cpu" in out


@pytest.mark.exactness
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
    out = run_script(ROOT / "examples/choose_placement_strategy.py", "--num-prompts", "4", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line[:1].isdigit()]
    assert len(lines) == 4 and all(line.count("%") == 5 for line in lines)


# --- KExpertsCPUBuffer ---------------------------------------------------------------------------------------
ATTACH_PROGRAM = """
import sys, torch
from tiermoe.compat import KExpertsCPUBuffer
from tiermoe.experts.weights import ExpertWeights
name, model = sys.argv[1], sys.argv[2]
with KExpertsCPUBuffer.attach(name, model, torch.float32) as buffer:
    seen = buffer.get(0, 3)
    print(repr(seen.gate_up.double().sum().item()), repr(seen.down.double().sum().item()))
    written = buffer.get(2, 5)  # an empty slot: this process writes it, the creator must see it
    buffer.put(2, 5, ExpertWeights(torch.full_like(written.gate_up, 7.0), torch.full_like(written.down, -2.0)))
"""


def test_cpu_buffer_holds_the_checkpoint_experts_and_another_process_sees_the_same_bytes(tmp_path):
    from transformers import AutoModelForCausalLM

    from tiermoe.compat import KExpertsCPUBuffer

    path = save_tiny("qwen3_moe", tmp_path / "model")  # layers 0 and 2 are MoE, 8 experts
    gpu_mask = torch.zeros(3, 8, dtype=torch.bool)
    gpu_mask[0, [0, 1]] = True
    gpu_mask[1] = True  # dense row, KTransformers' convention
    gpu_mask[2, 5] = True  # a GPU expert: its slot stays empty
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers
    with KExpertsCPUBuffer.from_checkpoint(path, gpu_mask, torch.float32) as buffer:
        assert buffer.nbytes == (6 + 7) * buffer.expert_nbytes  # exactly the CPU experts hold memory
        for layer, expert in ((0, 3), (2, 0), (2, 7)):
            experts = reference[layer].mlp.experts
            assert torch.equal(buffer.get(layer, expert).gate_up, experts.gate_up_proj[expert])
            assert torch.equal(buffer.get(layer, expert).down, experts.down_proj[expert])
        out = subprocess.run([sys.executable, "-c", ATTACH_PROGRAM, buffer.name, str(path)], capture_output=True, check=False,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        mine = buffer.get(0, 3)
        assert out.stdout.split() == [repr(mine.gate_up.double().sum().item()), repr(mine.down.double().sum().item())]
        assert (buffer.get(2, 5).gate_up == 7.0).all() and (buffer.get(2, 5).down == -2.0).all()
        assert buffer.nbytes == 14 * buffer.expert_nbytes


def test_cpu_buffer_sizes_release_and_close_free_the_memory(tiny_dir):
    from tiermoe.compat import KExpertsCPUBuffer
    from tiermoe.distributed.shm_store import SHM_DIR
    from tiermoe.errors import TiermoeError
    from tiermoe.experts.weights import ExpertWeights

    path = tiny_dir("olmoe")  # 2 MoE layers x 8 experts
    buffer = KExpertsCPUBuffer.create(path, torch.float32)
    spec = buffer.store.spec
    exact = (2 * spec.expert_intermediate_size * spec.hidden_size + spec.hidden_size * spec.expert_intermediate_size) * 4
    page = os.sysconf("SC_PAGE_SIZE")
    assert exact <= buffer.expert_nbytes < exact + page and buffer.expert_nbytes % page == 0
    assert buffer.capacity_nbytes == 2 * 8 * buffer.expert_nbytes
    assert buffer.nbytes == 0  # sparse: nothing written, nothing held
    slot = buffer.get(1, 4)
    buffer.put(1, 4, ExpertWeights(torch.ones_like(slot.gate_up), torch.ones_like(slot.down)))
    assert buffer.nbytes == buffer.expert_nbytes
    buffer.release(1, 4)
    assert buffer.nbytes == 0
    buffer.put(0, 0, ExpertWeights(torch.ones_like(slot.gate_up), torch.ones_like(slot.down)))
    files = sorted(SHM_DIR.glob(buffer.name + "*"))
    assert len(files) == 2
    buffer.close()
    assert not any(f.exists() for f in files)
    with pytest.raises(TiermoeError, match="no CPU expert buffer"):
        KExpertsCPUBuffer.attach(buffer.name, path, torch.float32)


def test_cpu_buffer_rejects_bad_positions_and_masks(tiny_dir):
    from tiermoe.compat import KExpertsCPUBuffer
    from tiermoe.errors import TiermoeError

    path = tiny_dir("qwen3_moe")
    with pytest.raises(TiermoeError, match=r"gpu_experts_mask has shape \[2, 8\], expected \[3, 8\]"):
        KExpertsCPUBuffer.create(path, gpu_experts_mask=torch.zeros(2, 8, dtype=torch.bool))
    with KExpertsCPUBuffer.create(path, torch.float32) as buffer:
        with pytest.raises(TiermoeError, match="layer 1 is not a MoE layer"):
            buffer.get(1, 0)
        with pytest.raises(TiermoeError, match="expert 8 is out of range"):
            buffer.get(0, 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_cpu_buffer_is_not_pinned_without_cuda(tiny_dir):
    from tiermoe.compat import KExpertsCPUBuffer
    from tiermoe.errors import TiermoeError

    path = tiny_dir("olmoe")
    with KExpertsCPUBuffer.create(path, torch.float32) as buffer:
        assert not buffer.pinned
        assert not buffer.get(0, 0).gate_up.is_pinned()
        assert not buffer.get_buffer(torch.zeros(2, 64), 2).input_cpu[0].is_pinned()
    with pytest.raises(TiermoeError, match="needs CUDA"):
        KExpertsCPUBuffer.create(path, torch.float32, pin=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_buffer_is_pinned_with_cuda(tiny_dir):
    from tiermoe.compat import KExpertsCPUBuffer

    path = tiny_dir("olmoe")
    with KExpertsCPUBuffer.create(path, torch.float32) as buffer:
        assert buffer.pinned
        slot = buffer.get(0, 3)
        assert slot.gate_up.is_pinned() and slot.down.is_pinned()
        staging = buffer.get_buffer(torch.zeros(2, 64, device="cuda"), 2)
        assert staging.input_cpu[0].is_pinned() and staging.output_gpu[0].is_cuda
        buffer.release(0, 3)  # unpinned, then punched out
        assert buffer.nbytes == 0


def test_staging_buffers_follow_kt_kernel(tiny_dir):
    from tiermoe.compat import KExpertsCPUBuffer

    with KExpertsCPUBuffer.create(tiny_dir("olmoe"), torch.float32) as buffer:
        x = torch.zeros(3, 64)
        inputs, immediate, deferred, weights, output, bsz, output_gpu = buffer.get_buffer(x, 2)
        assert len(inputs) == buffer.buffer_depth == 2
        assert inputs[0].shape == output[1].shape == output_gpu[0].shape == (3, 64)
        assert immediate[0].dtype == torch.int64 and weights[0].dtype == torch.float32 and weights[0].shape == (3, 2)
        assert (deferred[1] == -1).all() and bsz[0].tolist() == [3] and inputs[0].data_ptr() != inputs[1].data_ptr()
        assert buffer.get_buffer(x, 2) is buffer.get_buffer(x, 2)  # the last shape is reused
        buffer.set_capture_batch_sizes([3])
        captured = buffer.get_buffer(torch.zeros(3, 64, dtype=torch.float16), 2)
        buffer.get_buffer(torch.zeros(5, 64), 2)  # another batch size replaces the temporary buffer only
        assert buffer.get_buffer(torch.zeros(3, 64, dtype=torch.float16), 2) is captured
        assert buffer.get_buffer(x, 4).weights_cpu[0].shape == (3, 4)  # a new top-k: new buffers, not stale ones
        buffer.clear_buffer_cache()
        assert buffer.get_buffer(torch.zeros(3, 64, dtype=torch.float16), 2) is not captured


def test_move_non_experts_takes_ktransformers_three_argument_form(tiny_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny_dir("qwen2_moe")
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = get_moe_arch_config(AutoConfig.from_pretrained(path))
    experts = {n for n, _ in model.named_parameters() if ".mlp.experts." in n}
    assert move_non_experts_to_gpu(model, cfg, "meta") > 0
    assert {n for n, p in model.named_parameters() if not p.is_meta} == experts
    model = AutoModelForCausalLM.from_pretrained(path)
    assert move_non_experts_to_gpu(model, None, device="meta") > 0  # KT's keywords, config inferred
    assert move_non_experts_to_gpu(model, "meta") == 0  # the two-argument form still works (nothing left)


def _spec(path):
    return detect(load_config(path))


def test_a_ktransformers_device_map_is_a_placement(tiny_dir):
    path = tiny_dir("qwen3_moe")  # 3 layers x 8 experts, layer 1 dense
    spec = _spec(path)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, [1, 4]] = True
    mask[2, 7] = True
    plan = resolve_plan(build_device_map(mask, "cuda"), path, spec)
    assert torch.equal(plan.mask, mask)
    with_dense_row = mask.clone()
    with_dense_row[1] = True  # KTransformers' convention for a dense layer: its map round-trips
    assert torch.equal(resolve_plan(build_device_map(with_dense_row, "cuda"), path, spec).mask, mask)
    # The Hugging Face device_map KTransformers' fine-tuning loader builds: module names, the first n experts of
    # every layer on the GPU (dense layers have no expert modules: ignored), non-expert modules ignored.
    hf_map = {"model.embed_tokens": "cuda:0", "lm_head": "cuda:0"}
    for layer in range(3):
        hf_map[f"model.layers.{layer}"] = "cuda:0"
        for expert in range(8):
            hf_map[f"model.layers.{layer}.mlp.experts.{expert}"] = "cuda:0" if expert < 2 else "cpu"
    plan = resolve_plan(hf_map, path, spec)
    assert plan.gpu_experts_per_layer() == [2, 0, 2]
    two = resolve_plan({(0, 0): "cuda:0", (2, 3): 1, (2, 4): "cpu"}, path, spec, num_gpus=2)
    assert two.assignment[0, 0] == 0 and two.assignment[2, 3] == 1 and int((two.assignment >= 0).sum()) == 2


@pytest.mark.parametrize("device_map, message", [
    ({(0, 1): "meta"}, "unknown device 'meta'"),
    ({(0, 1): "gpu"}, "unknown device 'gpu'"),
    ({(5, 1): "cuda"}, r"\(layer 5, expert 1\) is outside the model"),
    ({(0, 8): "cuda"}, r"\(layer 0, expert 8\) is outside the model"),
    ({(1, 0): "cuda"}, "layer 1 is dense"),
    ({"layer0": "cuda"}, "names no routed expert"),
    ({(0, 0, 0): "cuda"}, "neither \\(layer, expert\\) nor a module name"),
    ({(0, 0): "cuda:0", (2, 0): "cuda:1"}, "uses cuda:1 but 1 GPU rank"),
])
def test_a_malformed_device_map_is_one_clear_line(tiny_dir, device_map, message):
    path = tiny_dir("qwen3_moe")
    with pytest.raises(TiermoeError, match=message) as error:
        resolve_plan(device_map, path, _spec(path))
    assert "\n" not in str(error.value)
