"""`tiermoe convert` writes into a temporary directory beside --out and renames it into place only when done: a
failed or interrupted conversion leaves nothing behind (no --out, no temporary directory), and the rerun works."""

from __future__ import annotations

import pytest
from conftest import run_cli
from safetensors.torch import load_file, save_file

import tiermoe.convert
from tiermoe.checkpoint.expert_cache import MANIFEST


@pytest.fixture
def source(tmp_path):
    from tiermoe.testing.make_model import make_model

    return make_model("qwen3_moe", tmp_path / "src", progress=False, config_overrides={
        "hidden_size": 128, "moe_intermediate_size": 64, "head_dim": 32})


def convert(source, out):
    return run_cli("convert", "--model", str(source), "--cpu-expert-dtype", "int8", "--out", str(out))


def assert_nothing_left(parent, *keep):
    assert sorted(p.name for p in parent.iterdir()) == sorted(keep)


def test_a_failed_convert_leaves_nothing_and_the_rerun_works(source, tmp_path):
    weights = source / "model.safetensors"
    good = weights.read_bytes()
    tensors = load_file(weights)
    last = max(int(k.split(".")[2]) for k in tensors if ".experts." in k)
    for name in [k for k in tensors if k.startswith(f"model.layers.{last}.mlp.experts.3.")]:
        del tensors[name]  # the last layer lacks an expert: conversion fails after writing the others
    save_file(tensors, weights, metadata={"format": "pt"})
    out = tmp_path / "out"
    failed = convert(source, out)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert "expert 3" in failed.stderr
    assert_nothing_left(tmp_path, "src")
    weights.write_bytes(good)
    rerun = convert(source, out)
    assert rerun.returncode == 0, rerun.stderr
    assert (out / MANIFEST).is_file() and (out / "config.json").is_file()
    assert_nothing_left(tmp_path, "src", "out")


def test_ctrl_c_during_convert_removes_the_partial_output(source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()  # an existing empty --out is allowed, and stays as it was
    real_writer = tiermoe.convert.StreamingLayerWriter
    written = []

    def interrupted_after_one_layer(path, specs):
        if written:
            raise KeyboardInterrupt
        written.append(path)
        return real_writer(path, specs)

    monkeypatch.setattr(tiermoe.convert, "StreamingLayerWriter", interrupted_after_one_layer)
    stopped = convert(source, out)
    assert stopped.returncode == 130 and "Traceback" not in stopped.stderr, stopped.stderr
    assert written and not written[0].exists()
    assert_nothing_left(tmp_path, "src", "out")
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    assert convert(source, out).returncode == 0
    assert (out / MANIFEST).is_file()
    assert_nothing_left(tmp_path, "src", "out")


def test_convert_onto_a_file_is_one_line(source, tmp_path):
    (tmp_path / "taken").write_text("x")
    r = convert(source, tmp_path / "taken")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "not a directory" in r.stderr and (tmp_path / "taken").read_text() == "x"
