"""--non-expert-dtype: the non-expert linears of a CPU-only run held packed and computed by the expert kernels."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import rel_err
from torch import nn

from tiermoe.arch import detect, load_config
from tiermoe.cli.cpu_flags import add_cpu_flags, cpu_from_args
from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.experts.kernels import ThreadTeam, load_kernels, supported_isa
from tiermoe.experts.quant import block, blocked_nbytes, dequantize, quantize
from tiermoe.fit import model_bytes
from tiermoe.layers.fused_decode_layer import FusedDecodeLayer
from tiermoe.layers.quantized_linear import QuantizedLinear
from tiermoe.model.loader import load_hybrid_model
from tiermoe.model.non_expert_quant import (
    INT6_IN_INT4,
    INT8_IN_INT4,
    KEPT_LINEARS,
    head_format,
    linear_format,
    quantizable_linears,
)
from tiermoe.bundled import resolve_model

needs_kernels = pytest.mark.skipif(supported_isa() is None, reason="the kernel library is unavailable")

# Median over positions of max |logits - fp32| / max |fp32 logits|, on tiny models with random weights
# (initializer_range 0.1, hidden 64): measured int8 0.009-0.017, int4 (groups of 32) 0.10-0.26; random
# Gaussian weights are int4's worst case, and a random router's near-tied scores flip a few positions much further
# under any weight error (bf16 weights flip them too), hence the median. Exactness is the other check: the
# quantised model computes, to fp32 rounding, the model whose linears hold the dequantised stored weights.
TOLERANCE = {"int8": 0.03, "int4": 0.4}
# Qwen3-Next's gated delta rule carries any error of a random in_proj_qkvz along the sequence (bf16 weights alone
# give 0.015, int8 0.07, int4 0.66 at the median position): only int8 is held to a bound there.
ARCH_TOLERANCE = {"qwen3_next": {"int8": 0.15, "int4": None}}
KEY_VALUE = {"deepseek_v3": {"kv_a_proj_with_mqa", "kv_b_proj"}}  # each layout's key / value projections (else k_proj, v_proj)


@pytest.fixture(scope="module")
def team():
    """A thread team of two for the module-level tests (a loaded model makes its own through its worker)."""
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("the kernel library is unavailable")
    made = ThreadTeam(kernels, 2)
    yield made
    made.close()


def test_a_quantized_linear_computes_the_linear_on_the_kernels_and_in_torch_alike(team):
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(200, 72, bias=True)  # neither dimension a multiple of the kernels' 16 x 32 / 64 tiles
    with torch.no_grad():
        linear.weight.copy_(torch.randn(72, 200, generator=g))
        linear.bias.copy_(torch.randn(72, generator=g))
    x = torch.randn(3, 5, 200, generator=g)
    ref = linear(x)
    for fmt, tol in (("bf16", 1e-2), ("int8", 1.5e-2), ("int4", 0.1)):
        q = QuantizedLinear(linear, fmt, load_kernels(), lambda: team)
        y = q(x)
        assert y.shape == ref.shape and y.dtype == torch.float32 and rel_err(y, ref) < tol, fmt
        fallback = QuantizedLinear(linear, fmt, None, lambda: team)  # no kernels: the same stored weight in torch
        assert rel_err(fallback(x), y) < 1e-5
        assert rel_err(q(x.bfloat16()).float(), ref) < tol + 2e-2  # bf16 activations stay bf16
        assert q(x[:, :0]).shape == (3, 0, 72)
        assert sum(b.numel() * b.element_size() for b in q.buffers()) == blocked_nbytes(fmt, 72, 200)


def test_blocked_nbytes_is_what_a_blocked_matrix_holds_and_small_matrices_unblock():
    for fmt in ("bf16", "int8", "int4"):
        for n, k in ((72, 200), (64, 256), (1, 40), (16, 64)):
            w = torch.randn(n, k)
            blocked = block(quantize(w, fmt))
            assert blocked.nbytes == blocked_nbytes(fmt, n, k)
            # and back (one strip of 16 rows, as a small projection has, included)
            assert torch.equal(dequantize(blocked, torch.float32), dequantize(quantize(w, fmt), torch.float32))


def _load(path, fmt, head=None, **kwargs):
    return load_hybrid_model(path, None, gpu_device="cpu", dtype=torch.float32, progress=False,
                             cpu=CPUConfig(non_expert_dtype=fmt, head_dtype=head), **kwargs)


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _dequantized_reference(hybrid, router_attr: str, fmt: str, head_fmt: str) -> None:
    """Put into a plain model's linears the weights `fmt` stores (each in `linear_format`'s format for it), into
    its head those `head_fmt` stores
    (dequantised to fp32): what a quantised load must compute exactly."""
    with torch.no_grad():
        for name, linear in quantizable_linears(hybrid.model, router_attr):
            linear.weight.copy_(dequantize(block(quantize(linear.weight, linear_format(name, fmt))), torch.float32))
        head = hybrid.model.get_output_embeddings()  # a copy of its own: a tied embedding table stays as loaded
        head.weight = nn.Parameter(dequantize(block(quantize(head.weight, head_fmt)), torch.float32))


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "qwen3_next", "deepseek_v3", "gpt_oss"])
def test_quantized_non_experts_compute_their_stored_weights_and_keep_routers_and_norms(tiny_dir, arch):
    path = tiny_dir(arch)
    spec = detect(load_config(path))
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    with _load(path, None) as plain:
        ref = plain(input_ids=ids).logits
        kept = {name: p for name, p in _params(plain.model).items()
                if "norm" in name or f".{spec.router_attr}." in name or "embed" in name}
        plain_bytes = plain.tier_bytes().non_expert
        linears = len(quantizable_linears(plain.model, spec.router_attr))
    exact = {}
    formats = (("int8", None), ("int4", None), ("int4", "int8"))  # (--non-expert-dtype, --head-dtype)
    for fmt, head in formats:
        with _load(path, None) as reference:
            _dequantized_reference(reference, spec.router_attr, fmt, head_format(fmt, head))
            exact[fmt, head] = reference(input_ids=ids).logits
    assert linears >= 4 * spec.num_layers  # at least q, k / kv, o... of every layer
    for fmt, head in formats:
        with _load(path, fmt, head) as hybrid:
            logits = hybrid(input_ids=ids).logits
            assert rel_err(logits, exact[fmt, head]) < 1e-4  # the stored weights, computed by the kernels in fp32
            per_position = (logits - ref).abs().amax(-1).flatten() / ref.abs().max()
            tolerance = ARCH_TOLERANCE.get(arch, TOLERANCE)[fmt]
            assert tolerance is None or per_position.median() < tolerance, (fmt, per_position)
            modules = dict(hybrid.model.named_modules())
            swapped = [name for name, m in modules.items() if isinstance(m, QuantizedLinear)]
            assert len(swapped) == linears + 1  # and the LM head
            head_module = hybrid.model.get_output_embeddings()
            assert isinstance(head_module, QuantizedLinear) and head_module.fmt == head_format(fmt, head)
            formats = {name: modules[name].fmt for name in swapped if modules[name] is not head_module}
            # int4 keeps the key / value projections in int8 (MLA: its latent one and its expansion), attention's
            # output in int6; the rest in the format asked
            other = {name.rpartition(".")[2] for name, f in formats.items() if f != fmt}
            more_bits = KEY_VALUE.get(arch, {"k_proj", "v_proj"}) | {"o_proj"}
            assert other == (more_bits if fmt == "int4" else set()), formats
            assert all(f == linear_format(name, fmt) for name, f in formats.items())
            left = [name for name, m in modules.items() if type(m) is nn.Linear]
            assert all(name.rpartition(".")[2] in (spec.router_attr, *KEPT_LINEARS) for name in left), left
            now = _params(hybrid.model)
            assert all(torch.equal(now[name], value) for name, value in kept.items())  # routers, norms, embeddings
            held = hybrid.tier_bytes().non_expert
            # fp32 linears: int8 holds about a quarter of their bytes (a tied head gets a copy of its own)
            assert held < plain_bytes * (0.75 if not load_config(path).tie_word_embeddings else 1.0)
            assert held == model_bytes(path, non_expert_dtype=fmt, head_dtype=head).non_expert + (
                plain_bytes - model_bytes(path).non_expert)  # `tiermoe fit` counts what the load holds


def test_an_int4_model_holds_keys_values_in_int8_its_output_and_head_in_int6_and_the_rest_as_asked():
    for leaves, more in ((INT8_IN_INT4, "int8"), (INT6_IN_INT4, "int6")):
        for leaf in leaves:
            assert linear_format(f"model.layers.3.self_attn.{leaf}", "int4") == more == linear_format(leaf, "int4")
            assert linear_format(f"model.layers.3.self_attn.{leaf}", "int8") == "int8"
            assert linear_format(f"model.layers.3.self_attn.{leaf}", "bf16") == "bf16"
    for name in ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj",
                 "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj", "self_attn.qkv_proj",
                 "mlp.down_proj", "mlp.shared_expert.up_proj", "mlp.shared_experts.gate_proj", "self_attn.k_proj_x"):
        assert linear_format(f"model.layers.0.{name}", "int4") == "int4", name  # fused or unknown: as asked
    assert [head_format(f) for f in ("bf16", "int8", "int4", "int6")] == ["bf16", "int8", "int6", "int6"]
    assert head_format("int4", "int4") == "int4" and head_format("int8", "int4") == "int4"


@needs_kernels
def test_generation_through_llm_runs_on_the_quantized_linears():
    with LLM("tiermoe-demo", cpu=CPUConfig(non_expert_dtype="int4"), progress=False) as llm:
        prompt = llm.encode("The capital of France is")
        out = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
        layer = llm.hybrid.model.model.layers[0]
        attention = layer.self_attn
        assert [attention.q_proj.fmt, attention.k_proj.fmt, attention.v_proj.fmt, attention.o_proj.fmt] == [
            "int4", "int8", "int8", "int6"]
        # q in one product, k and v stacked in another (DecodeFusedAttention), both in the layer's one native call
        assert [(p.fmt, p.out_features) for p in attention.stacked_qkv] == [("int4", 256), ("int8", 256)]
        assert isinstance(layer, FusedDecodeLayer) and (layer.args.qkv.N, layer.args.kv.N) == (256, 256)
        assert llm.hybrid.model.get_output_embeddings().fmt == "int6"
        ids = list(prompt)
        for _ in range(6):  # the same greedy tokens from whole-sequence forwards of the same model
            ids.append(int(llm.hybrid(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert list(out.token_ids) == ids[len(prompt):]
        other = llm.encode("Once upon a time")
        together = llm.generate([prompt, other], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert [list(o.token_ids) for o in together] == [list(out.token_ids), list(llm.generate(
            other, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids)]  # batch-invariant


def test_the_option_is_refused_off_cpu_for_training_and_when_unknown(tiny_dir):
    path = tiny_dir("qwen3_moe")
    with pytest.raises(TiermoeError, match=r"--non-expert-dtype int8 is for CPU-only runs \(--gpu-device cpu\)"):
        load_hybrid_model(path, None, gpu_device="cuda:0", cpu=CPUConfig(non_expert_dtype="int8"), progress=False)
    with pytest.raises(TiermoeError, match="a model to fine-tune keeps its non-expert weights"):
        _load(path, "int4", trainable=True)
    with pytest.raises(TiermoeError, match="non-expert dtype 'int3' is unknown; choose one of: none, bf16, int8, int4, int6"):
        CPUConfig(non_expert_dtype="int3")
    p = argparse.ArgumentParser()
    add_cpu_flags(p)
    assert cpu_from_args(p.parse_args(["--non-expert-dtype", "int4"])).non_expert_dtype == "int4"
    assert cpu_from_args(p.parse_args([])).non_expert_dtype is None
    assert cpu_from_args(p.parse_args(["--non-expert-dtype", "none"])).non_expert_dtype == "none"
    with pytest.raises(SystemExit):
        p.parse_args(["--non-expert-dtype", "fp4"])
    assert cpu_from_args(p.parse_args(["--non-expert-dtype", "int4", "--head-dtype", "int8"])).head_dtype == "int8"
    with pytest.raises(TiermoeError, match="LM head dtype 'int2' is unknown; choose one of: bf16, int8, int4, int6"):
        CPUConfig(non_expert_dtype="int4", head_dtype="int2")
    with pytest.raises(TiermoeError, match=r"--head-dtype int8 is for CPU-only runs"):
        load_hybrid_model(path, None, gpu_device="cuda:0", cpu=CPUConfig(head_dtype="int8"), progress=False)
    with pytest.raises(TiermoeError, match="--non-expert-dtype none keeps torch's linears: drop one of the two"):
        _load(path, "none", head="int8")
    with pytest.raises(TiermoeError, match="applies where the non-expert linears are packed"):
        _load(path, None, head="int8")  # an fp32 load keeps its linears as loaded unless told
    assert resolve_model("tiermoe-demo")  # the bundled model the generation test uses
