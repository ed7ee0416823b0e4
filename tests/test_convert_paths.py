"""A `tiermoe convert` output stands alone: it loads to the same logits after its source is moved or deleted and
after it is moved itself (the source's weights travel in its source/ folder, named relative to it), and its
README.md describes the conversion rather than repeating the source's model card."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch
from conftest import run_cli
from test_checkpoint_gguf import write_qwen3moe_gguf

import tiermoe.checkpoint.weight_copy
from tiermoe import LLM, SamplingParams
from tiermoe.arch import detect, load_config
from tiermoe.checkpoint.expert_cache import MANIFEST
from tiermoe.convert import convert_cpu_experts
from tiermoe.model.loader import load_hybrid_model
from tiermoe.testing.make_model import make_model

STALE_CARD = "# Qwen3-Tiny\n\nThe source's own card: its license and intended use.\n"


@pytest.fixture
def source(tmp_path):
    src = make_model("qwen3_moe", tmp_path / "src", progress=False, config_overrides={
        "hidden_size": 128, "moe_intermediate_size": 64, "head_dim": 32})
    (src / "README.md").write_text(STALE_CARD)
    return src


def half_on_gpu(model_dir) -> torch.Tensor:
    spec = detect(load_config(model_dir))
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    mask[list(spec.moe_layers), : spec.num_experts // 2] = True
    return mask


IDS = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))


def logits(model_dir, mask) -> torch.Tensor:
    """Logits with half the experts on the GPU tier (the CPU device here): both tiers read the output."""
    with load_hybrid_model(model_dir, mask, gpu_device="cpu", progress=False) as hybrid:
        return hybrid(input_ids=IDS).logits


def test_the_output_loads_the_same_after_the_source_is_moved_then_deleted_and_itself_moved(source, tmp_path):
    out = convert_cpu_experts(source, "int8", tmp_path / "converted", progress=False)
    mask = half_on_gpu(out)
    before = logits(out, mask)
    moved = source.rename(tmp_path / "src-moved")
    assert torch.equal(logits(out, mask), before)
    shutil.rmtree(moved)
    assert torch.equal(logits(out, mask), before)
    elsewhere = out.rename(tmp_path / "elsewhere")
    assert torch.equal(logits(elsewhere, mask), before)
    manifest = json.loads((elsewhere / MANIFEST).read_text())
    assert manifest["source"] == "source" and not os.path.isabs(manifest["source"])


def test_the_output_card_describes_the_conversion_and_keeps_the_sources_own(source, tmp_path):
    out = convert_cpu_experts(source, "int4", tmp_path / "converted", progress=False)
    card = (out / "README.md").read_text()
    assert "tiermoe convert --cpu-expert-dtype int4" in card and "int4" in card.splitlines()[0]
    assert "Qwen3-Tiny" not in card and "source/README.md" in card
    assert (out / "source" / "README.md").read_text() == STALE_CARD
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()


def test_on_the_same_filesystem_the_weights_are_hard_links_not_copies(source, tmp_path):
    out = convert_cpu_experts(source, "int8", tmp_path / "converted", progress=False)
    for weights in source.glob("*.safetensors"):
        assert (out / "source" / weights.name).stat().st_ino == weights.stat().st_ino
    assert "linked from the source" in (out / "README.md").read_text()


def test_where_links_are_refused_the_weights_are_copied_and_still_load(source, tmp_path, monkeypatch):
    def cross_device(src, dst, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(tiermoe.checkpoint.weight_copy.os, "link", cross_device)
    out = convert_cpu_experts(source, "int8", tmp_path / "converted", progress=False)
    for weights in source.glob("*.safetensors"):
        copied = out / "source" / weights.name
        assert copied.stat().st_ino != weights.stat().st_ino and copied.read_bytes() == weights.read_bytes()
    assert "copied from the source" in (out / "README.md").read_text()
    mask = half_on_gpu(out)
    before = logits(out, mask)
    shutil.rmtree(source)
    assert torch.equal(logits(out, mask), before)


def test_a_disk_too_small_for_the_copy_is_one_line_before_converting(source, tmp_path, monkeypatch):
    def cross_device(src, dst, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(tiermoe.checkpoint.weight_copy.os, "link", cross_device)
    monkeypatch.setattr(tiermoe.checkpoint.weight_copy.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    r = run_cli("convert", "--model", str(source), "--cpu-expert-dtype", "int8", "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "GiB are free" in r.stderr and "filesystem" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing half-written left


def test_a_converted_gguf_takes_text_without_the_gguf(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    write_qwen3moe_gguf(gguf, vocabulary=True)
    out = convert_cpu_experts(gguf, "int8", tmp_path / "converted", progress=False)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(out, progress=False) as llm:
        before = llm.generate("hello there", greedy)[0]
    gguf.unlink()
    with LLM(out, progress=False) as llm:
        after = llm.generate("hello there", greedy)[0]
    assert after.token_ids == before.token_ids and after.text == before.text
