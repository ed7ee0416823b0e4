"""Fused RMSNorm and softmax top-k routers (tiermoe.layers.fused_norm / fused_router): each one native call,
bit for bit transformers' module on every architecture, and fewer torch ops per decode step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import ARCHS
from transformers import AutoModelForCausalLM

import tiermoe.model.loader as loader
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.layer_ops import TORCH_GRAIN_SIZE, _row_stride, load_layer_ops
from tiermoe.layers.fused_grouped_router import FusedGroupedRouter, fuse_grouped_routers
from tiermoe.layers.fused_norm import NATIVE_MAX_ROWS, NORM_FORMS, FusedRMSNorm, FusedRMSNormGated, fuse_norms
from tiermoe.layers.fused_router import ROUTER_FORMS, FusedTopKRouter, fuse_routers
from tiermoe.model.loader import load_hybrid_model
from tiermoe.testing.op_counter import OpCounter
from tiermoe.testing.presets import make_config

OPS = load_layer_ops()
needs_ops = pytest.mark.skipif(OPS is None, reason="the kernel library is unavailable")
# and Qwen3.5-MoE's, a reference of its own (always renormalised, in the logits' dtype), its model from the zoo's tiny config
ROUTER_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_next", "gpt_oss", "qwen3_5_moe_text")
DTYPES = (torch.float32, torch.bfloat16)


def count_ops(fn, *args) -> int:
    counter = OpCounter()
    with counter:
        fn(*args)
    return counter.ops


def tiny_model(arch: str, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(arch, **overrides), dtype=torch.float32)


def norm_inputs(n: int, dtype: torch.dtype, g: torch.Generator) -> list[torch.Tensor]:
    """Decode- and prefill-shaped rows, rows strided inside a wider tensor, and leading dims that do not collapse."""
    def rand(*shape):
        return (torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 8).to(dtype)
    wide = rand(3, 4, n + 24)
    return [rand(1, 1, n), rand(3, 5, n), rand(2, 1, 2, n), wide[..., 5:5 + n], rand(4, 3, n).transpose(0, 1),
            rand(1, NATIVE_MAX_ROWS + 6, n)]


@pytest.mark.exactness
@needs_ops
@pytest.mark.parametrize("arch", ARCHS)
def test_every_rms_norm_of_every_architecture_is_fused_bit_for_bit(arch):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(1)
    norms = {}
    for module in model.modules():
        if NORM_FORMS.of(type(module)) is not None:
            norms.setdefault((type(module), module.weight.shape[0]), module)
    assert norms, arch
    for norm in norms.values():
        with torch.no_grad():
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=g) * 0.5 + 0.5)
        for dtype, w_dtype in ((torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)):
            original = copy.deepcopy(norm).to(w_dtype)
            fused = FusedRMSNorm(original, OPS)
            assert fused.weight is original.weight
            with torch.no_grad():
                for x in norm_inputs(original.weight.shape[0], dtype, g):
                    want, got = original(x), fused(x)
                    assert got.dtype == want.dtype and torch.equal(got, want), (type(norm).__name__, dtype, x.shape)
                assert count_ops(fused, x[:, :1]) == 1  # the output's allocation; the rest is one native call
    # with gradients to track it computes transformers' formula, so training gets the same gradients
    original = copy.deepcopy(next(iter(norms.values())))
    fused = FusedRMSNorm(copy.deepcopy(original), OPS)
    x = torch.randn(2, 3, original.weight.shape[0], generator=g)
    original(x).square().sum().backward()
    fused(x).square().sum().backward()
    assert torch.equal(fused.weight.grad, original.weight.grad)


@needs_ops
def test_qwen3_next_gated_norm_is_fused_bit_for_bit():
    if OPS.exp_lanes is None:
        pytest.skip(f"torch's {torch.backends.cpu.get_cpu_capability()} silu is not replicated")
    g = torch.Generator().manual_seed(3)
    norm = next(m for m in tiny_model("qwen3_next").modules() if type(m).__name__ == "Qwen3NextRMSNormGated")
    for n in (norm.weight.shape[0], 128):  # the tiny model's head_v_dim, and Qwen3-Next-80B's
        norm = type(norm)(n, eps=norm.variance_epsilon)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(n, generator=g) * 0.5 + 1)
        for dtype, w_dtype in ((torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)):
            original = copy.deepcopy(norm).to(w_dtype)
            fused = FusedRMSNormGated(original, OPS)
            # rows: one token's heads; a count whose elements end inside torch's vector loop; past the grain size
            for rows in (32, 3, 7, TORCH_GRAIN_SIZE // n + 1):
                x = (torch.randn(rows, n, generator=g) * 4).to(dtype)
                for gate in ((torch.randn(rows, n, generator=g) * 6).to(dtype), torch.randn(rows, n, generator=g)):
                    with torch.no_grad():
                        want, got = original(x, gate), fused(x, gate)
                    assert got.dtype == want.dtype and torch.equal(got, want), (n, dtype, w_dtype, rows, gate.dtype)
            with torch.no_grad():
                assert count_ops(fused, x[:2], gate[:2]) == 1


@needs_ops
@pytest.mark.parametrize("arch", ARCHS)
def test_fuse_norms_swaps_every_rms_norm(arch):
    model = tiny_model(arch)
    before = {name: m for name, m in model.named_modules() if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))}
    assert fuse_norms(model, OPS) == len(before) > 0
    for name, module in model.named_modules():
        if isinstance(module, (FusedRMSNorm, FusedRMSNormGated)):
            assert module.weight is before[name].weight
        else:
            assert not type(module).__name__.endswith(("RMSNorm", "RMSNormGated")), name
    meta = tiny_model(arch).to("meta")  # a module whose weight is not on the CPU (as on a CUDA device) stays
    assert fuse_norms(meta, OPS) == 0


def assert_router_outputs_equal(original, fused, d: int, dtype, g, case) -> torch.Tensor:
    """The fused router returns exactly what the original returns (dtypes, ids, weights and order) on one row,
    rows of any leading shape, zeros, inputs with few distinct logits (ties), and more rows than the native call
    takes; returns the last input. (GPT-OSS's router takes [T, D] alone: its softmax is over dim 1.)"""
    ties = (torch.randint(-2, 3, (6, d), generator=g) * 0.25).to(dtype)  # few distinct logits
    flat = type(original).__name__ == "GptOssTopKRouter"
    with torch.no_grad():
        for x in (torch.randn(1, d, generator=g).to(dtype), torch.randn(2, 3, d, generator=g).to(dtype),
                  torch.zeros(3, d, dtype=dtype), ties, torch.randn(NATIVE_MAX_ROWS + 3, d).to(dtype)):
            want, got = original(x.reshape(-1, d) if flat else x), fused(x)
            for w, o in zip(want, got):
                assert o.dtype == w.dtype and torch.equal(o, w), (case, dtype, x.shape)
    return x


def router_cases(arch: str):
    """(config overrides) for the router of `arch`: its tiny shape and real expert counts, renormalised or not."""
    experts = "num_local_experts" if arch in ("mixtral", "gpt_oss") else "num_experts"
    renorm = ({}, {}) if arch in ("mixtral", "gpt_oss") else ({"norm_topk_prob": False}, {"norm_topk_prob": True})
    return [{experts: 8, "num_experts_per_tok": 2}, {experts: 60, "num_experts_per_tok": 4, **renorm[0]},
            {experts: 128, "num_experts_per_tok": 8, **renorm[1]}, {experts: 512, "num_experts_per_tok": 10}]


@pytest.mark.exactness
@needs_ops
@pytest.mark.parametrize("arch", ROUTER_ARCHS)
def test_every_softmax_top_k_router_is_fused_bit_for_bit_ties_included(arch):
    if OPS.exp_lanes is None:
        pytest.skip(f"torch's {torch.backends.cpu.get_cpu_capability()} softmax is not replicated")
    g = torch.Generator().manual_seed(2)
    router_cls = next(type(m) for m in tiny_model(arch).modules()
                      if ROUTER_FORMS.of(type(m)) is not None)
    for overrides in router_cases(arch):
        config = make_config(arch, **overrides)
        router = router_cls(config)
        with torch.no_grad():  # multiples of 1/16: exact in bf16, so integer inputs can tie logits exactly
            router.weight.copy_((torch.randn(router.weight.shape, generator=g) * 2).round() / 16)
            if getattr(router, "bias", None) is not None:  # GPT-OSS's, the same kind of values
                router.bias.copy_((torch.randn(router.bias.shape, generator=g) * 2).round() / 16)
        for dtype in DTYPES:
            original = copy.deepcopy(router).to(dtype)
            fused = FusedTopKRouter(original, OPS)
            x = assert_router_outputs_equal(original, fused, config.hidden_size, dtype, g, overrides)
            with torch.no_grad():  # the linear and the two outputs' allocations
                assert count_ops(fused, x[:1]) == count_ops(F.linear, x[:1], fused.weight) + 2


GROUPED_CASES = {  # (config overrides, the routers' names of the expert count)
    "deepseek_v3": [{}, dict(n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8),
                    dict(n_routed_experts=64, n_group=1, topk_group=1, num_experts_per_tok=6, norm_topk_prob=False)],
    "glm4_moe": [{}, dict(n_routed_experts=128, n_group=1, topk_group=1, num_experts_per_tok=8)],
    "deepseek_v2": [{}, dict(n_routed_experts=64, topk_method="greedy", num_experts_per_tok=6),
                    dict(n_routed_experts=160, n_group=8, topk_group=3, num_experts_per_tok=6)],
}


@pytest.mark.exactness
@needs_ops
@pytest.mark.parametrize("arch", tuple(GROUPED_CASES))
def test_every_grouped_router_is_fused_bit_for_bit_in_torch_order(arch):
    if OPS.exp_lanes is None:
        pytest.skip(f"torch's {torch.backends.cpu.get_cpu_capability()} exp is not replicated")
    g = torch.Generator().manual_seed(4)
    router_cls = next(type(m) for m in tiny_model(arch).modules()
                      if type(m).__name__ in ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "DeepseekV2TopkRouter"))
    for i, overrides in enumerate(GROUPED_CASES[arch]):
        config = make_config(arch, **overrides)
        router = router_cls(config)
        with torch.no_grad():  # multiples of 1/16: integer inputs can tie logits exactly
            router.weight.copy_((torch.randn(router.weight.shape, generator=g) * 2).round() / 16)
            if hasattr(router, "e_score_correction_bias") and i > 0:  # the first case ties whole groups
                router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=g) * 0.1)
        for dtype in DTYPES:
            original = copy.deepcopy(router).to(dtype)
            if hasattr(original, "e_score_correction_bias"):
                original.e_score_correction_bias.data = router.e_score_correction_bias.clone()  # fp32, as loaded
            fused = FusedGroupedRouter(original, OPS)
            d = config.hidden_size
            x = assert_router_outputs_equal(original, fused, d, dtype, g, overrides)

            def linear(x):
                return F.linear(x.view(-1, d).type(torch.float32), fused.weight.type(torch.float32))
            with torch.no_grad():
                assert count_ops(fused, x[:1]) == count_ops(linear, x[:1]) + 2  # and the outputs' allocations


@needs_ops
def test_fuse_routers_swaps_every_router_but_gpt_oss():
    for arch in ARCHS:
        model = tiny_model(arch)
        swapped = fuse_routers(model, OPS)
        assert (swapped > 0) == (arch in ROUTER_ARCHS), arch
        assert swapped == sum(isinstance(m, FusedTopKRouter) for m in model.modules())
        grouped = fuse_grouped_routers(model, OPS)
        assert (grouped > 0) == (arch in GROUPED_CASES), arch
        assert grouped == sum(isinstance(m, FusedGroupedRouter) for m in model.modules())


def test_row_stride_collapses_leading_dims_or_says_it_cannot():
    x = torch.zeros(3, 4, 10)
    assert _row_stride(x) == 10
    assert _row_stride(x[..., 2:7]) == 10
    assert _row_stride(x[:, 1:2]) == 40  # size-1 dims do not count
    assert _row_stride(x[:, ::2]) == 20
    assert _row_stride(x.transpose(0, 1)) is None
    assert _row_stride(torch.zeros(7)) == 7


def decode_ops_per_layer(path, dtype) -> list[int]:
    """Torch ops inside each decoder layer during one decode step of one sequence."""
    llm = LLM(path, dtype=dtype, progress=False)
    counter, inside = OpCounter(), []
    per_layer = []

    def enter(*_):
        inside.append(counter.ops)

    def leave(*_):
        per_layer.append(counter.ops - inside.pop())

    try:
        for layer in llm.hybrid.model.model.layers:
            layer.register_forward_pre_hook(enter)
            layer.register_forward_hook(leave)
        llm.engine.add([3, 4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
        llm.engine.step()  # prefill
        per_layer.clear()
        with counter:
            llm.engine.step()
        return per_layer
    finally:
        llm.close()


@needs_ops
def test_a_decode_step_dispatches_fewer_ops_per_layer_by_what_was_fused(tiny_dir, monkeypatch):
    path = tiny_dir("qwen3_moe")  # q/k norms, a dense layer (no router) between MoE layers
    # the per-op fusions alone: not the whole-layer call (test_fused_decode_layer) nor the packed router
    monkeypatch.setattr(loader, "fuse_decode_layers", lambda model, kernels: 0)
    monkeypatch.setattr(loader, "pack_routers", lambda model, cpu, worker: 0)
    fused = decode_ops_per_layer(path, torch.bfloat16)
    monkeypatch.setattr(loader, "fuse_layer_ops", lambda model: (0, 0))
    original = decode_ops_per_layer(path, torch.bfloat16)
    model = tiny_model("qwen3_moe").to(torch.bfloat16)
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    with torch.inference_mode():  # as the engine runs (composite ops then dispatch as one)
        norm_saved = count_ops(model.model.norm, x) - 1
        router_saved = count_ops(model.model.layers[0].mlp.gate, x.view(1, 64)) - 2 - count_ops(
            F.linear, x.view(1, 64), model.model.layers[0].mlp.gate.weight)
    assert norm_saved >= 7 and router_saved >= 4
    layers = model.model.layers
    expected = [4 * norm_saved + (router_saved if hasattr(layer.mlp, "gate") else 0) for layer in layers]
    assert [o - f for o, f in zip(original, fused)] == expected


@pytest.mark.exactness
@needs_ops
@pytest.mark.parametrize("arch", ARCHS)
def test_a_loaded_model_computes_the_same_logits_fused_as_transformers_modules(tiny_dir, monkeypatch, arch):
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    logits = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(loader, "fuse_layer_ops", lambda model: (0, 0))
        with load_hybrid_model(tiny_dir(arch), None, gpu_device="cpu", dtype=torch.bfloat16,
                               progress=False) as hybrid:
            classes = {type(m) for m in hybrid.model.modules()}
            assert (FusedRMSNorm in classes) == fused
            assert (FusedTopKRouter in classes) == (fused and arch in ROUTER_ARCHS)
            assert (FusedGroupedRouter in classes) == (fused and arch in GROUPED_CASES)
            logits[fused] = hybrid(input_ids=ids).logits
    assert torch.equal(logits[True], logits[False])


def test_without_the_kernels_or_to_fine_tune_the_modules_stay_transformers(tiny_dir, monkeypatch):
    path = tiny_dir("qwen3_moe")
    fused_classes = (FusedRMSNorm, FusedRMSNormGated, FusedTopKRouter, FusedGroupedRouter)
    with load_hybrid_model(path, None, gpu_device="cpu", progress=False, trainable=True) as hybrid:
        assert not any(isinstance(m, fused_classes) for m in hybrid.model.modules())
    monkeypatch.setenv("TIERMOE_CPU_ISA", "torch")
    assert load_layer_ops() is None
    with load_hybrid_model(path, None, gpu_device="cpu", progress=False) as hybrid:
        assert not any(isinstance(m, fused_classes) for m in hybrid.model.modules())
