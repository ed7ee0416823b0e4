"""The console script: help with examples everywhere, inspect from headers, generate, version."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys

import pytest
from conftest import run_cli as cli
from conftest import save_char_tokenizer, save_tiny

from tiermoe.cli.main import COMMANDS


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


def test_the_console_script_runs_in_a_fresh_interpreter():
    result = subprocess.run([sys.executable, "-m", "tiermoe.cli.main", "version"], capture_output=True, text=True,
                            check=False)
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


def test_place_prints_the_table_and_writes_the_plan(tmp_path):
    result = cli("place", "--num-layers", "6", "--num-experts", "4", "--moe-layers", "2-5", "--kt-num-gpu-experts",
                 "2", "--kt-expert-placement-strategy", "front-loading", "--out", str(tmp_path / "p.json"),
                 "--plot", str(tmp_path / "p.png"))
    assert result.returncode == 0, result.stderr
    assert "8 of 16 routed experts" in result.stdout
    plan = json.loads((tmp_path / "p.json").read_text())
    assert [sum(1 for v in row if v >= 0) for row in plan["assignment"]] == [0, 0, 4, 4, 0, 0]
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_place_with_statistics_reports_the_hit_rate(tmp_path):
    import torch

    counts = torch.zeros(1, 3, 4)
    counts[0, :, 0] = 10
    counts[0, :, 1] = 1
    torch.save({"logical_count": counts}, tmp_path / "s.pt")
    result = cli("place", "--num-layers", "3", "--num-experts", "4", "--strategy", "frequency",
                 "--init-expert-location", str(tmp_path / "s.pt"), "--num-gpu-experts", "1", "--json")
    assert result.returncode == 0, result.stderr
    assert abs(json.loads(result.stdout)["expected_hit_rate"] - 10 / 11) < 1e-9


def test_generate_follows_a_plan(tmp_path, tiny_dir):
    import torch

    from tiermoe.engine.llm import LLM
    from tiermoe.placement.plan import PlacementPlan

    path = tiny_dir("qwen3_moe")
    out = tmp_path / "plan.json"
    assert cli("place", "--model", str(path), "--num-gpu-experts", "3", "--out", str(out)).returncode == 0
    plan = PlacementPlan.load(out)
    assert plan.gpu_experts_per_layer() == [3, 0, 3]  # layer 1 is dense (mlp_only_layers)
    with LLM(path, placement=plan, dtype=torch.float32, progress=False) as llm:
        assert torch.equal(llm.placement, plan.mask)
    wrong = cli("place", "--num-layers", "5", "--num-experts", "8", "--num-gpu-experts", "1", "--out",
                str(tmp_path / "wrong.json"))
    assert wrong.returncode == 0
    with_tokenizer = shutil.copytree(path, tmp_path / "model")
    save_char_tokenizer(with_tokenizer)
    result = cli("generate", "--model", str(with_tokenizer), "--prompt", "hi", "--plan", str(tmp_path / "wrong.json"))
    assert result.returncode == 2 and "plan is for 5 layers x 8 experts, the model has 3 x 8" in result.stderr


def test_chat_reads_a_pipe_and_keeps_history(tmp_path, monkeypatch):
    path = save_tiny("qwen3_moe", tmp_path / "m")
    save_char_tokenizer(path)
    # a pipe, as a file object: not a terminal, read line by line (in this process: no second interpreter to start)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/history\n/clear\n/history\nagain\n/quit\n"))
    result = cli("chat", "--local", str(path), "--max-tokens", "5", "--temperature", "0", "--no-save-history")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("assistant> ") == 2
    assert "user: hello" in out and "(conversation cleared)" in out
    assert out.index("(conversation cleared)") < out.index("you> again")
