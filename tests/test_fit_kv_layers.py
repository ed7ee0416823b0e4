"""KV cache bytes by layer kind: fit and the planner count what the engine's KV pool really holds.

Sliding-window layers (GPT-OSS) keep the last sliding_window - 1 tokens of each sequence, linear-attention layers
(Qwen3-Next) a fixed conv + recurrent state per sequence; full-attention layers every token.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli

from tiermoe import fit
from tiermoe.config import PlacementConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.model.plan_source import placement_target
from tiermoe.placement.budget import kv_bytes_per_token
from tiermoe.placement.kv_layout import kv_cache_bytes, kv_layout
from tiermoe.placement.planner import memory_budget
from tiermoe.testing.presets import make_config


def _held_bytes(pool, seq) -> int:
    """Bytes of the pool a sequence holds: its live pages in every group, its linear-attention slot."""
    pages = pool.pages
    held = sum(sum(1 for p in table if p >= 0) * pages.page_size * pages.bytes_per_token(w)
               for w, table in seq.pages.tables.items())
    return held + (pool.linear.nbytes() // pool.linear.num_slots if pool.linear is not None else 0)


def _run_until_held(llm, prompt_lengths: list[int]) -> list[tuple[int, int]]:
    """(tokens in the pool, bytes held) of each sequence, two decode steps after its prompt."""
    engine = llm.engine
    seqs = [engine.add(list(range(3, 3 + n)), SamplingParams(max_tokens=8, ignore_eos=True)) for n in prompt_lengths]
    while not all(s.num_fed >= len(s.prompt_ids) + 2 for s in seqs):
        engine.step()
    held = [(s.num_fed, _held_bytes(engine.pool, s)) for s in seqs]
    engine.run_to_completion()
    return held


@pytest.mark.parametrize("arch,dtype", [("gpt_oss", torch.float32), ("qwen3_next", torch.float32),
                                        ("qwen3_next", torch.bfloat16), ("qwen3_moe", torch.float32),
                                        ("deepseek_v3", torch.bfloat16)])
def test_the_formula_is_what_the_pool_holds_within_a_page_per_sequence(tiny_dir, arch, dtype):
    path = tiny_dir(arch)
    cfg = make_config(arch)
    page = 4
    with LLM(path, dtype=dtype, max_running=4, prefill_chunk=64, page_size=page, progress=False) as llm:
        runs = [_run_until_held(llm, lengths) for lengths in ([5], [30], [20, 40], [5, 40])]  # GPT-OSS window: 16
        assert llm.engine.pool.used_pages() == dict.fromkeys(llm.engine.pool.used_pages(), 0)  # all back
    layout = kv_layout(cfg, dtype.itemsize)
    # a group's pages round its tokens up to a page at each end: at most 2 pages more than the formula
    slack = 2 * page * (layout.full_per_token + layout.sliding_per_token)
    for tokens, held in (held for run in runs for held in run):
        want = kv_cache_bytes(cfg, dtype.itemsize, tokens, 1)
        assert want <= held < want + slack


def test_layer_kinds_of_the_tiny_models():
    oss = kv_layout(make_config("gpt_oss"), 4)
    # 1 sliding + 1 full layer of 2 KV heads x 16 x K and V x fp32; the window keeps 16 - 1 tokens
    assert (oss.full_per_token, oss.sliding_per_token, oss.sliding_tokens, oss.linear_state) == (256, 256, 15, 0)
    nxt = kv_layout(make_config("qwen3_next"), 2)
    # 3 linear layers: conv [2 x 2 x 16 + 4 x 16, kernel 4] in bf16 and a recurrent [4, 16, 16] in fp32, two banks
    assert (nxt.full_per_token, nxt.sliding_per_token, nxt.linear_state) == (128, 0, 3 * 2 * (128 * 4 * 2 + 1024 * 4))
    # MLA and GQA: every layer full, as before
    mla = kv_layout(make_config("deepseek_v3", "deepseek-v3"), 2)
    assert (mla.sliding_per_token, mla.linear_state) == (0, 0)
    assert kv_bytes_per_token(make_config("deepseek_v3", "deepseek-v3"), 2) == 70_272
    assert kv_bytes_per_token(make_config("qwen3_moe", "qwen3-30b-a3b"), 2) == 98_304
    assert kv_layout(make_config("qwen3_moe", "qwen3-30b-a3b"), 2).bytes(1000, 16) == 1000 * 98_304


def test_fit_counts_gpt_oss_20b_sliding_layers_at_their_window(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(make_config("gpt_oss", "gpt-oss-20b").to_dict()))
    r = run_cli("fit", "--model", str(config), "--dtype", "bf16", "--max-total-tokens", "32768")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # 12 full layers x 8 KV heads x 64 x K and V x 2 bytes per token; 12 sliding layers keep 127 tokens of each of
    # the 16 running sequences; no longer 49,152 B per token for all 24 layers
    assert "full layers 32768 tokens x 24576 B" in out
    assert "sliding-window layers 2032 tokens (16 sequences x at most 127) x 24576 B" in out
    assert "49152" not in out
    m = fit.model_bytes(config, dtype="bf16")
    assert fit.fit_report(m, 0, kv_tokens=32768, max_running=16).kv_cache == (32768 + 2032) * 24576
    assert fit.fit_report(m, 0, kv_tokens=100, max_running=16).kv_cache == 2 * 100 * 24576


def test_fit_counts_qwen3_next_linear_state_per_sequence(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(make_config("qwen3_next", "qwen3-next-80b-a3b").to_dict()))
    r = run_cli("fit", "--model", str(config), "--dtype", "bf16", "--max-total-tokens", "8192",
                             "--max-running-requests", "4")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # 36 linear layers: conv [2 x 16 x 128 + 32 x 128, kernel 4] in bf16 and a recurrent [32, 128, 128] in fp32,
    # in two banks
    state = 36 * 2 * (8192 * 4 * 2 + 32 * 128 * 128 * 4)
    assert f"linear-attention state 4 sequences x {state} B" in out
    assert "full layers 8192 tokens x 24576 B" in out  # 12 full layers x 2 KV heads x 256 x 2 x 2 bytes


def test_the_planner_and_the_running_check_count_every_layer_kind(tiny_dir, monkeypatch):
    target = placement_target(tiny_dir("gpt_oss"), torch.float32)
    config = PlacementConfig(gpu_memory_gb=1.0, kv_cache_tokens=1000, max_running=4)
    assert memory_budget(config, target, "cpu").kv_cache == 1000 * 256 + 4 * 15 * 256
    cfg = make_config("qwen3_next", "qwen3-next-80b-a3b")
    per_sequence = 2 * 24576 + 36 * 2 * (8192 * 4 * 2 + 32 * 128 * 128 * 4)  # 2 tokens and the linear state
    monkeypatch.setattr(fit, "device_free_bytes", lambda device: 10 * per_sequence)
    fit.check_running_kv(10, "--batch-size", cfg, torch.bfloat16, "cpu")
    with pytest.raises(TiermoeError, match=f"{per_sequence:,} bytes.*at most 10"):
        fit.check_running_kv(11, "--batch-size", cfg, torch.bfloat16, "cpu")
