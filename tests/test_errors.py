"""Bad input gets one clear line, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import save_tiny
from safetensors.torch import load_file, save_file

from tiermoe.errors import TiermoeError
from tiermoe.model.loader import load_hybrid_model


def cli(*args: str) -> subprocess.CompletedProcess:
    """A real second interpreter: proves the user sees one line and no traceback."""
    return subprocess.run([sys.executable, "-m", "tiermoe.cli.main", *args], capture_output=True, text=True)


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_missing_path(tmp_path):
    with pytest.raises(TiermoeError, match="does not exist"):
        load_hybrid_model(tmp_path / "nope", progress=False)


def test_directory_without_config(tmp_path):
    with pytest.raises(TiermoeError, match="has no config.json"):
        load_hybrid_model(tmp_path, progress=False)


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(TiermoeError, match="not valid JSON"):
        load_hybrid_model(tmp_path, progress=False)


def test_dense_model(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(TiermoeError, match="dense .* qwen3_moe"):
        load_hybrid_model(tmp_path, progress=False)


def test_llama4s_every_expert_call_is_accepted_and_the_load_goes_on_to_the_weights(tmp_path):
    from transformers import AutoConfig

    # Llama-4's experts take every expert's copy of every token (tiermoe.arch.experts_form reads that from their
    # numbers): the architecture passes, and a directory with a config and no weights is the next thing said
    AutoConfig.for_model("llama4_text", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                         intermediate_size=64, intermediate_size_mlp=64, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(TiermoeError, match="has no \\*.safetensors weights"):
        load_hybrid_model(tmp_path, progress=False)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    with pytest.raises(TiermoeError, match="unsupported model_type; tiermoe supports"):
        load_hybrid_model(tmp_path, progress=False)


def test_mask_of_wrong_shape(tiny_dir):
    with pytest.raises(TiermoeError, match=r"shape \[2, 8\], expected \[3, 8\]"):
        load_hybrid_model(tiny_dir("qwen3_moe"), torch.zeros(2, 8, dtype=torch.bool), progress=False)


def test_checkpoint_missing_an_expert(tmp_path):
    path = save_tiny("qwen3_moe", tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TiermoeError, match="missing expert 5 of layer 2"):
        load_hybrid_model(path, progress=False)


def test_truncated_safetensors(tmp_path):
    path = save_tiny("olmoe", tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(TiermoeError, match="not a valid safetensors file"):
        load_hybrid_model(path, progress=False)


def test_cli_errors_are_one_line(tmp_path):
    assert_one_line_error(cli("make-model", "--arch", "qwen3_moe", "--preset", "mixtral-8x7b", "--out",
                              str(tmp_path / "x")), "is a mixtral model")
    bad_flag = cli("make-model", "--arch", "qwen3_moe", "--layers", "-1", "--out", str(tmp_path / "y"))
    assert bad_flag.returncode == 2 and "Traceback" not in bad_flag.stderr
    assert "expected a positive integer" in bad_flag.stderr
