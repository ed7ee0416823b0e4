"""Whenever the bundled demo model stands in for a --model not given, one line on stderr says what it is and
where to find a real model: once per command, however often the command resolves the model, and never when
--model is given."""

from __future__ import annotations

import io
import json

import pytest
from conftest import run_cli, save_char_tokenizer, save_tiny
from serve_stub import replace_serve

from tiermoe.bundled import BUNDLED_MODEL_DIR, BUNDLED_MODEL_NAME, resolve_model
from tiermoe.bundled.demo_notice import DEMO_MODEL_NOTICE, demo_model_notice
from tiermoe.distributed.launch import free_port


def notices(stderr: str) -> int:
    return stderr.count(DEMO_MODEL_NOTICE)


def test_the_notice_is_one_line_naming_the_toy_and_the_way_to_a_real_model():
    assert DEMO_MODEL_NOTICE.startswith("the bundled demo model: 12M parameters")
    assert "not meant to make sense" in DEMO_MODEL_NOTICE and "README 'Run a real model'" in DEMO_MODEL_NOTICE
    assert "\n" not in DEMO_MODEL_NOTICE


def test_a_scope_says_it_once_and_only_for_the_default_model(capsys, tmp_path):
    resolve_model(None)  # outside a command (library use): silent
    assert capsys.readouterr().err == ""
    with demo_model_notice():
        assert resolve_model(tmp_path) == tmp_path
        assert resolve_model(BUNDLED_MODEL_NAME) == BUNDLED_MODEL_DIR  # named: the user knows what it is
        assert capsys.readouterr().err == ""
        for _ in range(3):
            assert resolve_model(None) == BUNDLED_MODEL_DIR
    assert capsys.readouterr().err == DEMO_MODEL_NOTICE + "\n"
    with demo_model_notice():  # the next command says it again
        resolve_model(None)
    assert notices(capsys.readouterr().err) == 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("tiny"))
    save_char_tokenizer(path)
    return path


@pytest.fixture
def serve_returns_at_once(monkeypatch):
    """`tiermoe serve` does all it does before listening, then returns."""
    replace_serve(monkeypatch, lambda state: None)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    return str(path)


def command_line(command: str, prompts: str, tmp_path) -> list[str]:
    return {
        "generate": ["generate", "--prompt", "Hi", "--max-tokens", "2"],
        "place": ["place", "--num-gpu-experts", "1"],
        "fit": ["fit", "--ram-gb", "64"],
        "serve": ["serve", "--port", str(free_port())],
        "record": ["record", "--dataset", prompts, "--num-prompts", "1", "--max-tokens", "2", "--no-progress",
                   "--out", str(tmp_path / "stats.pt")],
    }[command]


@pytest.mark.parametrize("command", ["generate", "place", "fit", "serve", "record"])
def test_each_command_on_the_demo_model_says_it_once(command, prompts, tmp_path, serve_returns_at_once):
    r = run_cli(*command_line(command, prompts, tmp_path))
    assert r.returncode == 0, r.stderr
    assert notices(r.stderr) == 1, r.stderr


def test_inspect_without_a_model_says_it_once():
    r = run_cli("inspect")
    assert r.returncode == 0 and notices(r.stderr) == 1, r.stderr


def test_chat_local_says_it_once(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("/quit\n"))
    r = run_cli("chat", "--local", "--no-save-history")
    assert r.returncode == 0, r.stderr
    assert notices(r.stderr) == 1, r.stderr


@pytest.mark.parametrize("command", ["generate", "place", "fit", "serve", "record"])
def test_a_given_model_gets_no_notice(command, tiny, prompts, tmp_path, serve_returns_at_once):
    r = run_cli(*command_line(command, prompts, tmp_path), "--model", str(tiny))
    assert r.returncode == 0, r.stderr
    assert notices(r.stderr) == 0 and "demo model" not in r.stderr, r.stderr
