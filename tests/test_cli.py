"""The console script: help with examples everywhere, inspect from headers, generate, version."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import save_char_tokenizer, save_tiny
from tiermoe.cli.main import COMMANDS


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiermoe.cli.main", *args], capture_output=True, text=True)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help_with_examples(command):
    result = cli(command, "--help")
    assert result.returncode == 0
    assert "examples:" in result.stdout and f"tiermoe {command}" in result.stdout


def test_inspect_reports_structure_and_bytes(tiny_dir):
    result = cli("inspect", str(tiny_dir("deepseek_v3")), "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["model_type"] == "deepseek_v3" and info["moe_layers"] == [1, 2]
    assert info["num_experts"] == 16 and info["top_k"] == 4
    assert info["bytes_per_expert"] == 3 * 64 * 32 * 4
    assert info["expert_bytes"] == 2 * 16 * info["bytes_per_expert"]
    table = cli("inspect", str(tiny_dir("deepseek_v3")))
    assert "deepseek_v3" in table.stdout and "1-2" in table.stdout


def test_generate_streams_text(tmp_path):
    path = save_tiny("qwen3_moe", tmp_path / "m")
    save_char_tokenizer(path)
    result = cli("generate", "--model", str(path), "--prompt", "hello", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip("\n")) > 0


def test_version():
    result = cli("version")
    assert result.returncode == 0 and result.stdout.startswith("tiermoe ")


@pytest.mark.parametrize("args, fragment", [
    (["inspect", "/no/such/dir"], "does not exist"),
    (["generate", "--model", "/no/such/dir", "--prompt", "x"], "does not exist"),
    (["generate", "--prompt", "x", "--gpu-device", "tpu"], "expected cpu, cuda or cuda:N"),
])
def test_user_errors_are_one_line(args, fragment):
    result = cli(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error:") and fragment in result.stderr


def test_bad_flag_values_say_what_is_expected():
    result = cli("generate", "--prompt", "x", "--top-p", "1.5")
    assert result.returncode == 2 and "expected a number in (0, 1]" in result.stderr
