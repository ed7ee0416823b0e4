"""CPU-tier backends: the native kernels on every ISA and format against the torch reference and transformers,
the forced fallbacks, the formats' stated errors and sizes, and the kt backend when kt-kernel is installed.

Legend: T tokens, D hidden, I intermediate, E experts, K top-k. Shapes are tiny; I=48 exercises padding.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from conftest import load_reference, rel_err

from tiermoe.config import CPUConfig
from tiermoe.errors import TiermoeError
from tiermoe.experts import kernels as kernels_mod
from tiermoe.experts.ffn import ExpertActivation, routed_experts_forward
from tiermoe.experts.kernels import ISA_NAMES, load_kernels, supported_isa
from tiermoe.experts.native import NativeCPUExperts
from tiermoe.experts.quant import dequantize, quantize
from tiermoe.experts.registry import make_cpu_tier
from tiermoe.experts.threads import default_threads, physical_cpus, team_cpus
from tiermoe.experts.tiers import CPUWorker, TorchCPUExperts
from tiermoe.experts.weights import ExpertWeights
from tiermoe.model.loader import load_hybrid_model

SILU = ExpertActivation("silu_glu")
FORMATS = ("bf16", "int8", "int4", "int6")
BEST = supported_isa()
ISAS = [*ISA_NAMES[: ISA_NAMES.index(BEST) + 1], "torch"] if BEST else ["torch"]


@pytest.fixture(autouse=True)
def teams_share_every_job(monkeypatch):
    """This file's experts are small: without this, a team of several would run them on its caller alone
    (kernels.SOLO_BYTES) and the comparisons across team sizes would not reach the helpers."""
    monkeypatch.setenv("TIERMOE_TEAM_SOLO_BYTES", "0")


def random_experts(d: int, i: int, e: int, seed: int = 0) -> dict[int, ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    return {x: ExpertWeights(torch.randn(2 * i, d, generator=g) * 0.1, torch.randn(d, i, generator=g) * 0.1)
            for x in range(e)}


def random_routing(t: int, d: int, e: int, k: int, seed: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    ids[0, 0] = -1  # a pair of the GPU tier
    return x, ids, torch.softmax(torch.randn(t, k, generator=g), dim=1)


def run(tier, x, ids, w) -> torch.Tensor:
    tier.submit(x, ids, w)
    return tier.sync()


def assert_tier_matches_reference(tier, held: dict, x, ids, w, act: ExpertActivation, bf16_math: bool, label):
    """fp32 and bf16 activations through `tier` against the torch reference on the experts it holds (`held`,
    dequantised): AMX and VDPBF16PS multiply bf16 activations (1e-2), every other path is exact fp32 (1e-5); bf16
    inputs give bf16 outputs within 2.5e-2 (int8 / int4 / int6 weights on the AVX512-BF16 level quantise them to
    int8 in blocks of 32: up to 0.021 measured, GPT-OSS's layer at 3 tokens)."""
    ref = routed_experts_forward(held, x, ids, w, act)
    assert rel_err(run(tier, x, ids, w), ref) < (1e-2 if bf16_math else 1e-5), label
    xb = x.to(torch.bfloat16)
    y = run(tier, xb, ids, w)
    assert y.dtype == torch.bfloat16
    assert rel_err(y.float(), routed_experts_forward(held, xb.float(), ids, w, act)) < 2.5e-2, label


@pytest.fixture
def worker():
    w = CPUWorker()
    yield w
    w.close()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_backend_matches_the_torch_reference_on_every_isa_and_format(isa, fmt, worker):
    d, i, e, k = 128, 64 if fmt == "bf16" else 48, 8, 2  # int formats pad I=48; bf16 needs multiples of 32
    tier = NativeCPUExperts(worker, SILU, fmt, torch.float32, threads=2, isa=isa)
    for x, w in random_experts(d, i, e).items():
        tier.add(x, w)
    dequantised = {x: tier.get(x) for x in range(e)}
    # AMX and VDPBF16PS multiply bf16 activations; every other path is exact fp32 on the stored weights.
    bf16_math = isa == "amx" or (isa == "avx512bf16" and fmt == "bf16")
    for t in (1, 3, 40):
        x, ids, w = random_routing(t, d, e, k)
        assert_tier_matches_reference(tier, dequantised, x, ids, w, SILU, bf16_math, t)
    assert tier.path == ("torch" if isa == "torch" else f"kernels/{isa}")


def test_tokens_with_no_cpu_pair_get_zeros_and_an_unheld_expert_is_an_error(worker):
    tier = NativeCPUExperts(worker, SILU, "bf16", torch.float32, threads=1)
    for x, w in random_experts(64, 32, 4).items():
        tier.add(x, w)
    x = torch.randn(3, 64)
    y = run(tier, x, torch.tensor([[-1, -1], [0, 1], [-1, -1]]), torch.ones(3, 2))
    assert torch.equal(y[0], torch.zeros(64)) and torch.equal(y[2], torch.zeros(64)) and y[1].abs().sum() > 0
    with pytest.raises(RuntimeError, match="expert 7 was routed to the CPU tier"):
        run(tier, x, torch.tensor([[7, -1], [0, 1], [-1, -1]]), torch.ones(3, 2))


def test_the_torch_fallback_is_forced_by_the_environment_and_gives_the_same_result(monkeypatch, worker):
    monkeypatch.setenv("TIERMOE_CPU_ISA", "torch")
    assert load_kernels() is None
    experts = random_experts(64, 32, 4)
    forced = NativeCPUExperts(worker, SILU, "int8", torch.float32, threads=1)
    monkeypatch.delenv("TIERMOE_CPU_ISA")
    native = NativeCPUExperts(worker, SILU, "int8", torch.float32, threads=1, isa="base" if BEST else "torch")
    for x, w in experts.items():
        forced.add(x, w)
        native.add(x, w)
    assert forced.path == "torch"
    x, ids, w = random_routing(5, 64, 4, 2)
    assert rel_err(run(forced, x, ids, w), run(native, x, ids, w)) < 1e-5


def test_a_failed_build_warns_once_and_falls_back_to_torch(monkeypatch, tmp_path, worker):
    broken = tmp_path / "broken-c++"
    broken.write_text("#!/bin/sh\necho 'error: this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(kernels_mod, "_compiler", lambda: str(broken))
    monkeypatch.setenv("TIERMOE_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="failed to build") as caught:
        assert load_kernels() is None
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second request does not warn again
        tier = NativeCPUExperts(worker, SILU, "bf16", torch.float32, threads=1)
    for x, w in random_experts(64, 32, 2).items():
        tier.add(x, w)
    assert tier.path == "torch"
    x, ids, w = random_routing(4, 64, 2, 1)
    ref = routed_experts_forward({x: tier.get(x) for x in range(2)}, x, ids, w, SILU)
    assert rel_err(run(tier, x, ids, w), ref) < 1e-5


def test_an_isa_above_the_cpu_or_unknown_is_refused():
    with pytest.raises(ValueError, match="unknown CPU ISA"):
        load_kernels("sse9")
    if BEST and BEST != "amx":
        with pytest.raises(ValueError, match="not supported by this CPU"):
            load_kernels("amx")


def layer_error(fmt: str, worker, seed: int = 0) -> float:
    """A layer's output against fp32, random-normal weights: max |y - ref| / max |ref|."""
    d, i, e, k, t = 512, 256, 8, 2, 64
    experts = random_experts(d, i, e, seed)
    tier = NativeCPUExperts(worker, SILU, fmt, torch.float32, threads=2)
    for x, w in experts.items():
        tier.add(x, w)
    x, ids, w = random_routing(t, d, e, k, seed)
    return rel_err(run(tier, x, ids, w), routed_experts_forward(experts, x, ids, w, SILU))


def test_formats_stay_within_their_documented_errors(worker):
    # docs/cpu-backends.md states measured errors; these bounds leave room for seed-to-seed spread
    assert layer_error("bf16", worker) < 1e-2
    assert layer_error("int8", worker) < 1.5e-2
    assert layer_error("int4", worker) < 0.2


def test_int4_is_stored_packed_in_at_most_0_56_bytes_per_parameter():
    w = torch.randn(1536, 2048)  # one Qwen3-30B-A3B gate_up
    q = quantize(w, "int4")
    assert q.nbytes / w.numel() <= 0.56
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == w.numel() // 2
    err = (dequantize(q, torch.float32) - w).norm() / w.norm()
    assert err < 0.085  # groups of 32 with a least-squares refit; plain min/max rounding gives about 0.09


@pytest.mark.skipif(BEST is None, reason="the kernel library is unavailable")
@pytest.mark.parametrize("fmt,row_bytes", [("int4", 128), ("int6", 192)])
def test_the_native_grouped_quantiser_matches_the_torch_reference(fmt, row_bytes):
    from tiermoe.experts.quant import _quantize_grouped

    w = torch.randn(96, 200, generator=torch.Generator().manual_seed(5))  # K not a multiple of 64: padded
    native, ref = _quantize_grouped(w, fmt, native=True), _quantize_grouped(w, fmt, native=False)
    assert native.codes.shape == ref.codes.shape == (96, row_bytes)
    assert (native.codes == ref.codes).float().mean() > 0.999  # float sums in another order may flip a tie
    assert torch.equal(native.gzero, ref.gzero)
    # a tie in a group scale's rounding may go the other way and move its whole group (one of 672 here)
    apart = (dequantize(native, torch.float32) - dequantize(ref, torch.float32)).abs() > 1e-3
    assert apart.float().mean() < 0.01
    errs = [(dequantize(q, torch.float32) - w).norm() / w.norm() for q in (native, ref)]
    assert abs(errs[0] - errs[1]) < 0.01 * errs[1]


def test_get_gives_the_canonical_expert_back_and_pop_releases_it(worker):
    experts = random_experts(64, 48, 3)
    for fmt in FORMATS:
        tier = NativeCPUExperts(worker, SILU, fmt, torch.float32, threads=1)
        for x, w in experts.items():
            tier.add(x, w)
        before = tier.nbytes
        got = tier.pop(1)
        assert got.gate_up.shape == (96, 64) and got.down.shape == (64, 48) and got.gate_up.dtype == torch.float32
        if fmt == "bf16":
            assert torch.equal(got.gate_up, experts[1].gate_up.to(torch.bfloat16).float())
        assert 1 not in tier and len(tier) == 2
        # int4 / int6 keep the stored form (the next test): its bytes stay until the expert comes back
        grouped = fmt in ("int4", "int6")
        assert tier.parked(1) == grouped and tier.nbytes == (before if grouped else before * 2 // 3)
        tier.add(1, got)  # back again: quantising dequantised weights keeps them
        assert rel_err(tier.get(1).down, got.down) < (0.05 if grouped else 1e-6)
        assert not tier.parked(1) and tier.nbytes == before  # what is added replaces a kept form


def test_registry_picks_backends_and_keeps_fp32_experts_exact(worker):
    fp32 = make_cpu_tier(CPUConfig(), worker, SILU, False, torch.float32)
    assert isinstance(fp32, TorchCPUExperts)  # an fp32 checkpoint without --cpu-expert-dtype stays exact
    bf16 = make_cpu_tier(CPUConfig(), worker, SILU, False, torch.bfloat16)
    assert isinstance(bf16, NativeCPUExperts) and bf16.fmt == "bf16" and bf16.threads == default_threads()
    int4 = make_cpu_tier(CPUConfig(expert_dtype="int4", threads=3), worker, SILU, False, torch.float32)
    assert int4.fmt == "int4" and int4.threads == 3
    with pytest.raises(TiermoeError, match="cpu backend 'fast' is unknown; choose one of: native, torch, kt"):
        CPUConfig(backend="fast")


def test_default_threads_leave_a_core_for_the_caller_and_pinning_can_be_turned_off(monkeypatch):
    cores = physical_cpus()
    assert default_threads() == max(1, len(cores) - 1)
    assert team_cpus(1) == cores[-1:]
    assert team_cpus(len(cores) + 1) == []  # more threads than cores: left to the scheduler
    monkeypatch.setenv("TIERMOE_CPU_PIN", "0")
    assert team_cpus(1) == []


def test_more_threads_than_cores_still_compute_the_same(worker):
    experts = random_experts(128, 64, 8)
    tiers = [NativeCPUExperts(worker, SILU, "int4", torch.float32, threads=n) for n in (1, 5)]
    for tier in tiers:
        for x, w in experts.items():
            tier.add(x, w)
    x, ids, w = random_routing(20, 128, 8, 2)
    assert rel_err(run(tiers[1], x, ids, w), run(tiers[0], x, ids, w)) < 1e-5


def input_ids() -> torch.Tensor:
    return torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("fmt,tol", [("bf16", 1e-2), ("int8", 3e-2), ("int4", 0.25)])
def test_a_model_on_the_native_backend_gives_transformers_logits(fmt, tol, tiny_dir):
    path = tiny_dir("qwen3_moe")
    with torch.no_grad():
        ref = load_reference(path)(input_ids()).logits
    from tiermoe.arch import detect, load_config

    spec = detect(load_config(path))
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    mask[spec.moe_layers[0], :3] = True  # some experts on the GPU tier (here: the host)
    with load_hybrid_model(path, mask, dtype=torch.float32, cpu=CPUConfig(expert_dtype=fmt),
                           progress=False) as hybrid:
        block = hybrid.blocks[spec.moe_layers[0]]
        assert isinstance(block.cpu_tier, NativeCPUExperts)
        assert rel_err(hybrid(input_ids=input_ids()).logits, ref) < tol
        hybrid.move_experts(spec.moe_layers[0], [5], to_gpu=True)
        hybrid.move_experts(spec.moe_layers[0], [1], to_gpu=False)
        assert rel_err(hybrid(input_ids=input_ids()).logits, ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int4_expert_comes_back_from_the_gpu_tier_as_it_was_stored(dtype, tiny_dir):
    """int4 quantised again from its dequantised copy moves about a tenth of the codes, so an expert would drift
    with every round trip through the GPU tier; the tier keeps the stored form instead, and a demotion restores
    it without a copy."""
    path = tiny_dir("qwen3_moe")
    from tiermoe.arch import detect, load_config
    from tiermoe.experts.copier import AsyncCopier

    spec = detect(load_config(path))
    layer = spec.moe_layers[0]
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    with torch.no_grad(), load_hybrid_model(path, mask, dtype=dtype, cpu=CPUConfig(expert_dtype="int4"),
                                            progress=False) as hybrid:
        block = hybrid.blocks[layer]
        before, held = hybrid(input_ids=input_ids()).logits, block.cpu_tier.nbytes
        hybrid.move_experts(layer, [1, 2, 3], to_gpu=True)
        assert all(block.cpu_tier.parked(e) and e not in block.cpu_tier for e in (1, 2, 3))
        assert block.cpu_tier.nbytes == held  # the kept forms are host memory, counted
        assert hybrid.move_experts(layer, [1], to_gpu=False) == 0  # the tier swap path: nothing copied
        copier = AsyncCopier()  # and dynamic placement's asynchronous path
        ticket = block.start_move(2, False, copier)
        assert ticket.landed() and block.finish_move(2, False, ticket.result()) == 0
        copier.close()
        assert 1 in block.cpu_tier and 2 in block.cpu_tier and not block.cpu_tier.parked(2)
        assert block.cpu_tier.parked(3) and 3 in block.gpu_tier
        hybrid.move_experts(layer, [3], to_gpu=False)
        assert torch.equal(hybrid(input_ids=input_ids()).logits, before)
        assert block.cpu_tier.nbytes == held


def test_gpt_oss_bf16_experts_the_kernels_would_pad_keep_the_torch_path(tiny_dir):
    """The tiny GPT-OSS's intermediate size (48) is not a multiple of 32: its bf16 experts stay on the exact torch
    path, as every such bf16 layer does (GPT-OSS on the kernels: tests/test_cpu_kernels_gpt_oss.py)."""
    path = tiny_dir("gpt_oss")
    with torch.no_grad():
        ref = load_reference(path)(input_ids()).logits
    with load_hybrid_model(path, None, dtype=torch.float32, cpu=CPUConfig(expert_dtype="bf16"),
                           progress=False) as hybrid:
        assert all(b.cpu_tier.path == "torch" for b in hybrid.blocks.values())
        assert rel_err(hybrid(input_ids=input_ids()).logits, ref) < 1e-2


def test_kt_backend_without_kt_kernel_says_how_to_install_it(monkeypatch, worker):
    monkeypatch.setitem(sys.modules, "kt_kernel", None)
    with pytest.raises(TiermoeError, match="pip install --no-deps kt-kernel"):
        make_cpu_tier(CPUConfig(backend="kt"), worker, SILU, False, torch.bfloat16)


def test_kt_backend_matches_the_torch_reference(worker):
    pytest.importorskip("kt_kernel")
    if BEST != "amx":
        pytest.skip("kt-kernel's operators here need AMX")
    from tiermoe.experts.kt import KtCPUExperts

    experts = random_experts(256, 128, 8)
    tier = KtCPUExperts(worker, SILU, "bf16", torch.float32, threads=1)
    for x, w in experts.items():
        if x != 3:
            tier.add(x, w)
    x, ids, w = random_routing(6, 256, 8, 2)
    ids[ids == 3] = -1
    ref = routed_experts_forward({x: tier.get(x) for x in range(8) if x != 3}, x, ids, w, SILU)
    assert rel_err(run(tier, x, ids, w), ref) < 1e-2


def test_cli_flags_choose_the_cpu_tier_with_sglang_kt_spellings_too():
    import argparse

    from tiermoe.cli.cpu_flags import add_cpu_flags, cpu_from_args

    p = argparse.ArgumentParser()
    add_cpu_flags(p)
    assert cpu_from_args(p.parse_args([])) == CPUConfig()
    assert cpu_from_args(p.parse_args(["--kt-method", "AMXINT4", "--kt-cpuinfer", "3"])) == \
        CPUConfig(backend="native", expert_dtype="int4", threads=3)
    assert cpu_from_args(p.parse_args(["--cpu-backend", "torch", "--cpu-expert-dtype", "bf16"])) == \
        CPUConfig(backend="torch", expert_dtype="bf16")
    with pytest.raises(TiermoeError, match="disagree"):
        cpu_from_args(p.parse_args(["--cpu-expert-dtype", "int8", "--kt-method", "AMXINT4"]))


def test_generate_runs_on_a_quantised_cpu_tier_and_bad_cpu_flags_are_one_line_errors(tmp_path):
    from conftest import run_cli, save_char_tokenizer, save_tiny

    path = save_tiny("qwen3_moe", tmp_path / "m")
    save_char_tokenizer(path)
    ok = run_cli("generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "4", "--cpu-expert-dtype",
                 "int8", "--cpu-threads", "1")
    assert ok.returncode == 0, ok.stderr
    for args, fragment in [(["--kt-method", "FP8"], "--kt-method 'FP8' is not supported"),
                           (["--cpu-threads", "0"], "expected a positive integer"),
                           (["--cpu-backend", "gpu"], "invalid choice")]:
        bad = run_cli("generate", "--model", str(path), "--prompt", "hi", *args)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and fragment in bad.stderr, bad.stderr


@pytest.mark.skipif(BEST is None, reason="the kernel library is unavailable")
@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != "torch"])
def test_an_int4_tier_with_int6_down_projections_computes_what_it_holds(isa, worker):
    """gate_up in int4 and down in int6 (an int4 model's default, CPUConfig.down_format): each matrix is computed in
    its own format, exact in fp32 on the vector levels, and held in the bytes of each."""
    d, i = 96, 48  # K padded for int4 / int6 (64), I padded in gate_up's rows and down's columns alike
    tier = NativeCPUExperts(worker, SILU, "int4", torch.float32, threads=2, isa=isa, down_fmt="int6")
    experts = random_experts(d, i, 4)
    for x, w in experts.items():
        tier.add(x, w)
    held = {x: tier.get(x) for x in experts}
    stored = tier._experts[0]
    assert (stored.gate_up.fmt, stored.down.fmt) == ("int4", "int6")
    assert tier.path == f"kernels/{isa}"
    all_int4 = NativeCPUExperts(worker, SILU, "int4", torch.float32, threads=1, isa=isa)
    all_int4.add(0, experts[0])
    # int6 downs: a quarter of the error of int4's
    down_err = [rel_err(t.get(0).down, experts[0].down) for t in (tier, all_int4)]
    assert down_err[0] < 0.35 * down_err[1], down_err
    g = torch.Generator().manual_seed(3)
    for t in (1, 5):
        x = torch.randn(t, d, generator=g)
        ids = torch.rand(t, 4, generator=g).topk(2, dim=1).indices
        w = torch.softmax(torch.randn(t, 2, generator=g), dim=1)
        tol = 1e-2 if isa == "amx" and t >= tier.amx_min_rows else 1e-5
        assert rel_err(run(tier, x, ids, w), routed_experts_forward(held, x, ids, w, SILU)) < tol, t


def test_an_expert_down_format_is_refused_where_it_cannot_be_held(worker):
    with pytest.raises(ValueError, match="cannot sit beside gate_up in bf16"):
        NativeCPUExperts(worker, SILU, "bf16", torch.float32, threads=1, down_fmt="int6")
    assert CPUConfig(expert_dtype="int4").down_format == "int6" and CPUConfig(expert_dtype="int8").down_format == "int8"
    assert CPUConfig(expert_dtype="int4", expert_down_dtype="int4").down_format == "int4"
    assert CPUConfig().down_format is None
    with pytest.raises(TiermoeError, match="needs the native backend and --cpu-expert-dtype int4 or int6"):
        CPUConfig(expert_dtype="int8", expert_down_dtype="int6")
    with pytest.raises(TiermoeError, match="needs the native backend"):
        CPUConfig(backend="kt", expert_dtype="int4", expert_down_dtype="int4")
    with pytest.raises(TiermoeError, match="cpu expert down dtype 'int5' is unknown"):
        CPUConfig(expert_dtype="int4", expert_down_dtype="int5")
