"""Architecture discovery (tiermoe.arch.discover) and what is built on it: the tuned families keep their specs and
fast paths, the other families run their own block forward with the experts on the two tiers (exactly, in torch
where the kernels lack their activation, said once), kinds the KV pool lacks are refused by name, tiny configs are
shrunk by rules that fail loudly, and `tiermoe inspect` / `tiermoe fit` read a config.json alone."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import run_cli
from transformers import AutoConfig, AutoModelForCausalLM

from tiermoe.arch import SUPPORTED_MODEL_TYPES, detect
from tiermoe.arch.discover import discover
from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.errors import TiermoeError
from tiermoe.layers.hybrid_moe import HybridMoE
from tiermoe.model.catalogue import parts_of
from tiermoe.model.hybrid_experts import HybridExperts
from tiermoe.model.loader import load_hybrid_model
from tiermoe.testing.presets import TINY, make_config
from tiermoe.testing.tiny_configs import shrink_fields, tiny_config
from tiermoe.testing.zoo_exactness import write_tiny

# What discovery must give the tuned families (HybridMoE's own block forward): router, shared experts, activation,
# the released disk block, and the MoE layers of the tiny configs (dense layers where the config puts them).
TUNED_SPECS = {
    "qwen3_moe": ("gate", "none", "silu_glu", "mlp", (0, 2)),  # mlp_only_layers=[1]
    "qwen2_moe": ("gate", "gated", "silu_glu", "mlp", (0, 1)),
    "qwen3_next": ("gate", "gated", "silu_glu", "mlp", (0, 1, 2, 3)),
    "mixtral": ("gate", "none", "silu_glu", "block_sparse_moe", (0, 1)),
    "deepseek_v2": ("gate", "plain", "silu_glu", "mlp", (1, 2)),
    "deepseek_v3": ("gate", "plain", "silu_glu", "mlp", (1, 2)),
    "glm4_moe": ("gate", "plain", "silu_glu", "mlp", (1, 2)),
    "olmoe": ("gate", "none", "silu_glu", "mlp", (0, 1)),
    "gpt_oss": ("router", "none", "gpt_oss_glu", "mlp", (0, 1)),
}


@pytest.mark.parametrize("arch", TINY)
def test_discovery_gives_each_tuned_family_the_spec_its_fast_path_needs(arch):
    spec = detect(make_config(arch))
    assert (spec.router_attr, spec.shared_kind, spec.activation, spec.disk.block, spec.moe_layers) == TUNED_SPECS[arch]
    assert spec.block_forward == "tiermoe" and spec.moe_path == "mlp" and spec.gated
    assert spec.returns_router_scores == (arch == "gpt_oss") == spec.expert_bias


def test_every_other_family_keeps_its_own_block_forward():
    spec = detect(tiny_config("phimoe"))
    assert spec.block_forward == "model" and spec.model_type not in SUPPORTED_MODEL_TYPES
    assert spec.router_kind == "the model's own PhimoeTopKRouter" and spec.disk.fused_kind == "transformers"


def test_the_fused_native_decode_paths_take_the_classes_whose_code_is_theirs():
    # whole-layer native decode call, fused qkv + rotary attention, routers and norms: what each family's modules
    # take on the CPU, found from their code (tiermoe.arch.code_form), not their names
    def decode(arch):
        config = make_config(arch) if arch in TINY else tiny_config(arch)
        return parts_of(detect(config), discover(config)).decode

    everything = "whole layer in one native call, fused attention, fused router, fused norms"
    assert decode("qwen3_moe") == decode("mixtral") == decode("gpt_oss") == everything
    assert decode("qwen2_moe") == "fused attention, fused router, fused norms"  # its shared experts: per op
    assert decode("mellum") == everything  # Qwen3-MoE's attention, router, norms, layer and block, by other names
    assert decode("dots1") == "fused attention, fused router, fused norms"  # a shared expert: per op
    assert decode("phimoe") == "fused attention"  # Qwen2-MoE's attention; LayerNorms, a sparsemixer router
    assert decode("deepseek_v3") == "MLA attention in one native call, fused router, fused norms"
    assert decode("ernie4_5_moe") == "fused norms"  # its rotary (interleaved) is not Qwen2-MoE's


def test_a_discovered_family_runs_its_experts_on_both_tiers_in_its_own_block(tmp_path):
    write_tiny("minimax_m2", tmp_path)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[:, ::2] = True
    with load_hybrid_model(tmp_path, mask, gpu_device="cpu", dtype=torch.float32, progress=False) as hybrid:
        block = hybrid.model.model.layers[0].mlp
        assert not isinstance(block, HybridMoE) and isinstance(block.experts, HybridExperts)
        assert hybrid.blocks[0] is block.experts and len(block.experts.gpu_tier) == 4
        assert torch.equal(hybrid.mask, mask)


def test_experts_the_kernels_cannot_compute_run_in_torch_and_say_why_once(tmp_path, caplog):
    write_tiny("beam", tmp_path)  # its own _apply_gate (a clamped SwiGLU of other constants)
    spec = detect(AutoConfig.from_pretrained(tmp_path))
    assert spec.activation == "model"
    with caplog.at_level(logging.INFO, logger="tiermoe.model.loader"), load_hybrid_model(
            tmp_path, None, gpu_device="cpu", dtype=torch.bfloat16, progress=False,
            cpu=CPUConfig(backend="native")) as hybrid:
        assert all(b.cpu_tier.path == "torch" for b in hybrid.blocks.values())
    lines = [r.getMessage() for r in caplog.records if "compute in torch" in r.getMessage()]
    assert len(lines) == 1 and "BeamExperts._apply_gate" in lines[0], lines


def test_an_engine_over_a_kind_the_pool_lacks_is_refused_in_one_line_naming_it(tmp_path):
    write_tiny("minimax", tmp_path)  # lightning attention: a linear-attention state the pool does not hold
    with pytest.raises(TiermoeError, match="KV pool does not hold linear_attention:MiniMaxLightningAttention") as err:
        LLM(tmp_path, dtype=torch.float32, progress=False)
    assert "\n" not in str(err.value)


def test_shrinking_fails_loudly_on_a_size_field_no_rule_names():
    with pytest.raises(TiermoeError, match="'frobnicator_width' = 4096 looks like a size"):
        shrink_fields({"num_hidden_layers": 4, "hidden_size": 4096, "frobnicator_width": 4096})


def test_shrinking_keeps_every_layer_kind_and_the_sums_among_head_dims():
    cfg = tiny_config("qwen3_next")  # three linear-attention layers, then a full one
    assert cfg.num_hidden_layers == 4 and cfg.layer_types[-1] == "full_attention"
    mla = tiny_config("deepseek_v3")  # one dense layer first; query head = nope + rope; rope head = head_dim
    assert mla.first_k_dense_replace == 1 and mla.qk_head_dim == mla.qk_nope_head_dim + mla.qk_rope_head_dim
    assert mla.head_dim == mla.qk_rope_head_dim and mla.hidden_size == 64
    model = AutoModelForCausalLM.from_config(mla)
    assert sum(p.numel() for p in model.parameters()) < 500_000


def test_inspect_and_fit_read_a_discovered_architectures_config_json_alone(tmp_path):
    AutoConfig.for_model("minimax_m2").save_pretrained(tmp_path)  # the release's sizes, no weights
    shown = run_cli("inspect", str(tmp_path / "config.json"))
    assert shown.returncode == 0, shown.stderr
    assert "the model's own MiniMaxM2SparseMoeBlock" in shown.stdout and "256 per MoE layer, top-8" in shown.stdout
    fit = run_cli("fit", "--model", str(tmp_path), "--dtype", "bf16", "--gpu-memory-gb", "24", "--ram-gb", "1024")
    assert fit.returncode == 0, fit.stderr
    assert "62 MoE layers x 256 experts" in fit.stdout


def test_a_block_with_a_tuned_familys_block_code_runs_hybrid_moes_forward():
    # Mellum's block is Qwen3-MoE's code, Qwen3.5-MoE's Qwen2-MoE's (a gated shared expert), Dots1's DeepSeek-V3's
    specs = {arch: detect(tiny_config(arch)) for arch in ("mellum", "qwen3_5_moe_text", "dots1", "phimoe")}
    assert {arch: (s.block_forward, s.shared_kind) for arch, s in specs.items()} == {
        "mellum": ("tiermoe", "none"), "qwen3_5_moe_text": ("tiermoe", "gated"), "dots1": ("tiermoe", "plain"),
        "phimoe": ("model", "none")}  # PhiMoE's block is its own (sparsemixer routing, jitter)
    assert specs["mellum"].router_kind == "the model's own MellumTopKRouter"
    assert specs["dots1"].disk.block == "mlp"  # read under its own names, as before


def test_make_config_takes_every_moe_family_as_the_zoo_shrinks_it():
    config = make_config("mellum", num_hidden_layers=3)  # its per-layer lists follow
    assert config.model_type == "mellum" and config.num_hidden_layers == 3
    assert len(config.layer_types) == len(config.mlp_layer_types) == 3
    assert config.hidden_size == tiny_config("mellum").hidden_size
    with pytest.raises(TiermoeError, match="another MoE model type of the installed transformers"):
        make_config("llama")  # dense: no fused experts module
