"""`tiermoe fit` (byte counts before loading, checked against hand-computed numbers and against what a load
really holds) and `tiermoe convert` (the CPU-tier cache)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import run_cli

from tiermoe.checkpoint.expert_cache import MANIFEST
from tiermoe.config import CPUConfig
from tiermoe.fit import fit_report, model_bytes
from tiermoe.model.loader import load_hybrid_model
from tiermoe.testing.presets import PRESETS, make_config

GIB = 1 << 30


def _write_config(tmp_path, preset: str, **extra):
    cfg = make_config(PRESETS[preset][0], preset)
    raw = cfg.to_dict()
    raw.update(extra)
    out = tmp_path / preset
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    return out / "config.json"


def _fp8(n: int, k: int) -> int:
    """An FP8 Linear weight [n, k]: one byte per parameter plus one fp32 scale per 128x128 block."""
    return n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)


def test_fit_counts_qwen3_30b_a3b_bytes_by_hand(tmp_path):
    config = _write_config(tmp_path, "qwen3-30b-a3b")
    m = model_bytes(config, "bf16")
    h, layers, vocab, experts, inter = 2048, 48, 151936, 128, 768
    q, kv = 32 * 128, 4 * 128
    per_layer = h * q + 2 * h * kv + q * h + 2 * 128 + 2 * h  # q, k, v, o, q/k norms, two layer norms
    router = experts * h * 2  # the router, in the model dtype (DeepSeek-V3's is fp32, see below)
    assert m.non_expert == (2 * vocab * h + h + layers * per_layer) * 2 + layers * router
    assert m.gpu_bytes_per_expert == 3 * h * inter * 2
    assert m.load_buffer == 3 * h * inter * 2
    assert m.cpu_bytes_per_expert == 3 * h * inter * 2  # bf16
    assert m.kv_bytes_per_token == layers * 2 * kv * 2
    assert m.total_experts == layers * experts
    int4 = model_bytes(config, "bf16", "int4")
    # gate_up [1536, 2048]: codes 1/2 byte, gscale 1/32, zero 1/64 per parameter; down [2048, 768] int6: codes 3/4,
    # gscale and zero 1/32 each; 4 per row
    int6_down = h * inter * (3 / 4 + 2 / 32)
    assert int4.cpu_bytes_per_expert == 2 * h * inter * (1 / 2 + 1 / 32 + 1 / 64) + int6_down + 4 * (2 * inter + h)
    assert int4.cpu_formats == "int4, down projections int6"
    all_int4 = model_bytes(config, "bf16", "int4", cpu_expert_down_dtype="int4")
    assert all_int4.cpu_bytes_per_expert == 3 * h * inter * (1 / 2 + 1 / 32 + 1 / 64) + 4 * (2 * inter + h)
    report = fit_report(m, kv_tokens=4096, gpu_memory_gb=24, ram_gb=64)
    workspaces = (32 + 1) * 2**20  # cuBLAS + cuBLASLt of the one forward thread (Hopper)
    left = 24 * GIB - m.non_expert - 4096 * m.kv_bytes_per_token - workspaces
    assert report.max_gpu_experts == left // m.gpu_bytes_per_expert
    assert report.gpu_experts == report.max_gpu_experts and not report.problems()


def test_fit_counts_deepseek_v3_fp8_bytes_by_hand(tmp_path):
    config = _write_config(tmp_path, "deepseek-v3")
    m = model_bytes(config, "fp8", "int4")
    h, layers, dense, vocab, inter, moe_inter, experts = 7168, 61, 3, 129280, 18432, 2048, 256
    attn = (_fp8(1536, h) + _fp8(128 * 192, 1536) + _fp8(576, h) + _fp8(128 * 256, 512) + _fp8(h, 128 * 128)
            + (1536 + 512) * 2)  # q_a, q_b, kv_a, kv_b, o; the two latent norms in bf16
    norms = 2 * h * 2
    dense_mlp = 2 * _fp8(inter, h) + _fp8(h, inter)
    moe = experts * h * 4 + experts * 4 + 2 * _fp8(moe_inter, h) + _fp8(h, moe_inter)  # fp32 router + bias, shared
    expected = 2 * vocab * h * 2 + h * 2 + layers * (attn + norms) + dense * dense_mlp + (layers - dense) * moe
    assert m.non_expert == expected
    assert m.gpu_bytes_per_expert == 2 * _fp8(moe_inter, h) + _fp8(h, moe_inter)  # GPU-tier experts stay FP8
    assert m.load_buffer == 3 * h * moe_inter * 2  # a CPU-tier expert streams through a bf16 buffer
    assert m.kv_bytes_per_token == layers * (512 + 64) * 2  # the MLA latent (tiermoe.layers.mla_attention)
    assert m.total_experts == (layers - dense) * experts
    # sanity in round numbers: ~17 B non-expert parameters, 1.85 B of them bf16 embeddings -> ~19 GB
    assert 18e9 < m.non_expert < 20e9
    assert m.cpu_bytes_per_expert == (2 * h * moe_inter * (1 / 2 + 1 / 32 + 1 / 64) + h * moe_inter * (3 / 4 + 2 / 32)
                                      + 4 * (2 * moe_inter + h))  # down projections int6
    # 654 B expert parameters, two thirds at 0.547 B each, the down projections' third at 0.81 (int4 throughout: 358 GB)
    assert 412e9 < m.total_experts * m.cpu_bytes_per_expert < 418e9


def test_fit_cli_from_config_alone_prints_every_part_and_fails_when_it_will_not_fit(tmp_path):
    config = _write_config(tmp_path, "deepseek-v3")
    r = run_cli("fit", "--model", str(config), "--dtype", "fp8", "--cpu-expert-dtype", "int4",
                "--gpu-memory-gb", "80", "--ram-gb", "512", "--max-total-tokens", "4096")
    assert r.returncode == 0, r.stderr
    for part in ("non-expert weights", "KV cache", "prefill buffer", "CPU-tier experts", "largest GPU expert count",
                 "kept int4 forms"):  # what dynamic placement may add beside an int4 tier
        assert part in r.stdout
    assert "verdict                     fits" in r.stdout or "fits" in r.stdout.splitlines()[-1]
    small = run_cli("fit", "--model", str(config), "--dtype", "fp8", "--gpu-memory-gb", "16", "--ram-gb", "256")
    assert small.returncode == 1
    assert "does not fit" in small.stdout and "GPU memory" in small.stdout and "host memory" in small.stdout
    none = run_cli("fit", "--model", str(config))
    assert none.returncode == 2 and "--dtype" in none.stderr and "Traceback" not in none.stderr
    head = run_cli("fit", "--model", str(config), "--dtype", "bf16", "--head-dtype", "int4")
    assert head.returncode == 2 and "give --non-expert-dtype too" in head.stderr and "Traceback" not in head.stderr


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fit_bytes_equal_what_a_load_really_holds(tmp_path, fmt):
    from tiermoe.testing.make_model import make_model

    path = make_model("qwen3_moe", tmp_path / "m", progress=False, config_overrides=dict(
        hidden_size=128, moe_intermediate_size=64, head_dim=32))
    # the load below is CPU-only: its bf16 linears and routers are packed (tiermoe.model.cpu_only)
    m = model_bytes(path, cpu_expert_dtype=fmt, non_expert_dtype="bf16")
    spec = m.spec
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    mask[spec.moe_layers[0], :3] = True
    with load_hybrid_model(path, mask, progress=False, cpu=CPUConfig(expert_dtype=fmt)) as hybrid:
        held = hybrid.tier_bytes()
    report = fit_report(m, gpu_experts=3)
    assert 0 <= held.non_expert - m.non_expert <= 1024  # the rotary frequency buffers: computed, not weights
    assert held.gpu_experts == 3 * m.gpu_bytes_per_expert
    assert held.cpu_experts == report.cpu_experts


def test_generate_stops_before_loading_when_the_gpu_limit_cannot_hold_the_model():
    r = run_cli("generate", "--prompt", "hi", "--gpu-memory-gb", "0.001", "--max-tokens", "2")
    assert r.returncode == 2
    assert "will not fit" in r.stderr and "GPU memory" in r.stderr and "Traceback" not in r.stderr
    assert "loading" not in r.stderr  # stopped before reading any weight


# ---- tiermoe convert: the CPU-tier cache ----

def _tiny_aligned(tmp_path, name="src"):
    from tiermoe.testing.make_model import make_model

    return make_model("qwen3_moe", tmp_path / name, progress=False, config_overrides=dict(
        hidden_size=128, moe_intermediate_size=64, head_dim=32))


@pytest.mark.parametrize("fmt,down", [("int4", None), ("int4", "int4"), ("int8", None), ("bf16", None)])
def test_converted_cache_loads_to_the_same_logits_as_converting_at_load(tmp_path, fmt, down):
    src = _tiny_aligned(tmp_path)
    r = run_cli("convert", "--model", str(src), "--cpu-expert-dtype", fmt, "--out", str(tmp_path / "c"),
                *(["--cpu-expert-down-dtype", down] if down else []))
    assert r.returncode == 0, r.stderr
    cache = tmp_path / "c"
    manifest = json.loads((cache / MANIFEST).read_text())
    assert manifest["down_format"] == (down or {"int4": "int6"}.get(fmt, fmt))  # int4's downs int6 unless asked
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    with load_hybrid_model(src, None, progress=False,
                           cpu=CPUConfig(expert_dtype=fmt, expert_down_dtype=down)) as direct:
        want = direct(input_ids=ids).logits
        want_bytes = direct.tier_bytes()
    with load_hybrid_model(cache, None, progress=False) as cached:
        got = cached(input_ids=ids).logits
        got_bytes = cached.tier_bytes()
        assert cached.model_dir == cache
    assert torch.equal(got, want)  # the same stored codes: bit-identical
    assert got_bytes == want_bytes


def test_a_cached_load_maps_the_files_instead_of_quantising(tmp_path, monkeypatch):
    from tiermoe.experts import native, quant

    src = _tiny_aligned(tmp_path)
    from tiermoe.convert import convert_cpu_experts

    convert_cpu_experts(src, "int4", tmp_path / "c", progress=False)

    def refuse(*args, **kwargs):
        raise AssertionError("quantised again")

    monkeypatch.setattr(native, "quantize", refuse)
    monkeypatch.setattr(quant, "quantize", refuse)
    spec_mask = None
    with load_hybrid_model(tmp_path / "c", spec_mask, progress=False) as hybrid:
        assert hybrid.tier_bytes().cpu_experts > 0


def test_a_stale_or_mismatched_cache_is_refused_or_bypassed_with_a_message(tmp_path):
    from tiermoe.convert import convert_cpu_experts
    from tiermoe.errors import TiermoeError

    src = _tiny_aligned(tmp_path)
    cache = convert_cpu_experts(src, "int8", tmp_path / "c", progress=False)
    with pytest.warns(UserWarning, match="holds native int8"):
        with load_hybrid_model(cache, None, progress=False, cpu=CPUConfig(expert_dtype="int4")) as hybrid:
            assert hybrid.tier_bytes().cpu_experts > 0
    weights = next(src.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # same bytes, new mtime: the source may have changed
    import os

    os.utime(weights, ns=(1, 1))
    with pytest.raises(TiermoeError, match="run `tiermoe convert` again"):
        load_hybrid_model(cache, None, progress=False)
    r = run_cli("convert", "--model", str(src), "--cpu-expert-dtype", "int4", "--out", str(cache))
    assert r.returncode == 2 and "not empty" in r.stderr


def test_convert_streams_an_fp8_source(tmp_path):
    from tiermoe.convert import convert_cpu_experts
    from tiermoe.testing.fp8_write import write_fp8_checkpoint

    fp8 = write_fp8_checkpoint(_tiny_aligned(tmp_path), tmp_path / "fp8")
    cache = convert_cpu_experts(fp8, "int8", tmp_path / "c", progress=False)
    ids = torch.randint(3, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    with load_hybrid_model(fp8, None, progress=False, cpu=CPUConfig(expert_dtype="int8")) as direct:
        want = direct(input_ids=ids).logits
    with load_hybrid_model(cache, None, progress=False) as cached:
        assert torch.equal(cached(input_ids=ids).logits, want)
    fit = run_cli("fit", "--model", str(cache))
    assert fit.returncode == 0 and "(int8)" in fit.stdout


def test_a_cache_written_for_the_kernels_loads_on_a_machine_without_them(tmp_path, monkeypatch):
    from tiermoe.convert import convert_cpu_experts

    src = _tiny_aligned(tmp_path)
    cache = convert_cpu_experts(src, "int4", tmp_path / "c", progress=False)
    monkeypatch.setenv("TIERMOE_CPU_ISA", "torch")  # the torch path computes from the "rows" layout
    ids = torch.randint(3, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    with load_hybrid_model(src, None, progress=False, cpu=CPUConfig(expert_dtype="int4")) as direct:
        want = direct(input_ids=ids).logits
    with load_hybrid_model(cache, None, progress=False) as cached:
        assert torch.equal(cached(input_ids=ids).logits, want)


def test_a_version_1_cache_is_read_unless_its_int4_codes_are_in_the_old_order(tmp_path):
    from tiermoe.checkpoint.expert_cache import MANIFEST, find_cache
    from tiermoe.convert import convert_cpu_experts
    from tiermoe.errors import TiermoeError

    src = _tiny_aligned(tmp_path)
    for fmt in ("int8", "int4"):
        cache = convert_cpu_experts(src, fmt, tmp_path / fmt, progress=False, down_fmt=fmt)
        manifest = json.loads((cache / MANIFEST).read_text())
        manifest["version"] = 1  # as written before int4's chunks were interleaved by row
        del manifest["down_format"]
        (cache / MANIFEST).write_text(json.dumps(manifest))
        if fmt == "int8":
            assert find_cache(cache).down_fmt == "int8"
        else:
            with pytest.raises(TiermoeError, match="layout of cache version 1.*run `tiermoe convert` again"):
                find_cache(cache)
