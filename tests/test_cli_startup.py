"""`tiermoe CMD --help`, `tiermoe version`, `tiermoe --version` and a bad flag never import torch or transformers
(seconds of start-up for a page of text): each runs in a fresh interpreter that then lists what it imported. The
parsers read their choices from tiermoe.cli.choices, whose copies must equal the library's values. Commands whose
work needs no transformers model class (a plan from a shape, `stats` of a file) run without importing transformers.
(benchmarks/bench_cli_startup.py times the same commands.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tiermoe.analysis.placement_traffic import BENCH_STRATEGIES
from tiermoe.arch import SUPPORTED_MODEL_TYPES
from tiermoe.cli import choices
from tiermoe.cli.extras import DATASET_MODULES
from tiermoe.cli.main import COMMANDS
from tiermoe.data.registry import DATASETS
from tiermoe.distributed.group import DEFAULT_DIST_TIMEOUT_S
from tiermoe.engine import speculative_config
from tiermoe.layers.decode_attention import ATTENTION_BACKENDS
from tiermoe.layers.routed_autograd import DEFAULT_CHUNK
from tiermoe.model.served_adapters import DEFAULT_MAX_LOADED, MAX_LOADED
from tiermoe.placement.cache_policies import DEFAULT_COPY_BUDGET
from tiermoe.routing.presets import PRESETS as ROUTING_PRESETS
from tiermoe.routing.trace_import import LAYOUTS
from tiermoe.stats.recorders import MODES, SGLANG_DEFAULT_BUFFER_SIZE
from tiermoe.testing.presets import PRESETS
from tiermoe.training.finetune import DEFAULT_MAX_LENGTH
from tiermoe.training.kt_env import MAX_SEQUENCE
from tiermoe.training.lora import MAX_RANK

HEAVY = ("torch", "transformers")
# commands whose parser module still imports its run (torch, seconds): to leave this set once split like the others
NOT_YET_LIGHT: set[str] = set()

CHILD = """
import contextlib, io, json, sys
from tiermoe.cli.main import main
heavy, argv = sys.argv[1].split(","), sys.argv[2:]
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
print(json.dumps({"code": code, "imported": [m for m in heavy if m in sys.modules], "output": out.getvalue()}))
"""


def run_fresh(*argv: str) -> dict:
    """`tiermoe ARGV` in a fresh interpreter: its exit code, the heavy modules it imported, and its output."""
    done = subprocess.run([sys.executable, "-c", CHILD, ",".join(HEAVY), *argv], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("command", [
    pytest.param(name, marks=pytest.mark.skip(reason=f"{name}'s parser module still imports its run"))
    if name in NOT_YET_LIGHT else name for name in sorted(COMMANDS)])
def test_help_of_every_command_leaves_torch_and_transformers_unloaded(command):
    result = run_fresh(command, "--help")
    assert result["code"] == 0 and f"tiermoe {command}" in result["output"]
    assert result["imported"] == [], f"`tiermoe {command} --help` imported {result['imported']}"


@pytest.mark.parametrize("argv", [("version",), ("--version",), ("-V",), ("--help",), ("place", "--no-such-flag"),
                                  ("genrate",), ("generate", "--top-p", "2")])
def test_version_and_mistakes_leave_torch_and_transformers_unloaded(argv):
    result = run_fresh(*argv)
    assert result["imported"] == [], f"`tiermoe {' '.join(argv)}` imported {result['imported']}"
    assert result["code"] in (0, 2) and result["output"]


def test_the_parsers_copies_of_library_values_are_the_library_values():
    assert choices.RECORDER_MODES == MODES and choices.SGLANG_DEFAULT_BUFFER_SIZE == SGLANG_DEFAULT_BUFFER_SIZE
    assert choices.ATTENTION_BACKENDS == ATTENTION_BACKENDS
    assert choices.TUNED_MODEL_TYPES == SUPPORTED_MODEL_TYPES
    assert choices.MODEL_PRESETS == {name: arch for name, (arch, _) in PRESETS.items()}
    assert choices.BENCH_STRATEGIES == BENCH_STRATEGIES and choices.DEFAULT_COPY_BUDGET == DEFAULT_COPY_BUDGET
    assert choices.FINETUNE_MAX_LENGTH == DEFAULT_MAX_LENGTH and choices.MAX_LORA_RANK == MAX_RANK
    assert choices.DEFAULT_EXPERT_CHUNK == DEFAULT_CHUNK and choices.MAX_TRAINING_SEQUENCE == MAX_SEQUENCE
    assert choices.ROUTING_PRESETS == tuple(ROUTING_PRESETS) and choices.TRACE_LAYOUTS == LAYOUTS
    assert choices.SPECULATIVE_ALGORITHMS == speculative_config.ALGORITHMS
    assert (choices.MAX_DRAFT_TOKENS, choices.MAX_NGRAM) == (speculative_config.MAX_DRAFT_TOKENS,
                                                              speculative_config.MAX_NGRAM)
    assert choices.DEFAULT_DIST_TIMEOUT_S == DEFAULT_DIST_TIMEOUT_S
    assert (choices.DEFAULT_LOADED_ADAPTERS, choices.MAX_LOADED_ADAPTERS) == (DEFAULT_MAX_LOADED, MAX_LOADED)
    assert set(DATASET_MODULES) == set(DATASETS)  # every named dataset's package is checked before a run


# Commands whose work needs no transformers model class run to the end without importing transformers: a plan from
# a model's shape, the statistics of a heat-matrix file (tiermoe.arch, tiermoe.experts and the placement code they
# import load transformers only in the functions that build or read its modules).
@pytest.mark.parametrize("argv, shown", [
    (("place", "--num-layers", "4", "--num-experts", "8", "--num-gpu-experts", "2"), "total GPU experts: 8 of 32"),
    (("stats", "{heat}"), "routed (token, expert) pairs 10"),
])
def test_commands_that_need_no_model_class_run_without_transformers(tmp_path, argv, shown):
    heat = tmp_path / "heat.csv"
    heat.write_text("layer,e0,e1\n0,1,2\n1,3,4\n")
    result = run_fresh(*(arg.format(heat=heat) for arg in argv))
    assert result["code"] == 0 and shown in result["output"], result["output"]
    assert "transformers" not in result["imported"], f"`tiermoe {argv[0]}` imported transformers"


def test_parse_command_gives_the_run_function_and_flags_without_running_it():
    from tiermoe.cli import stats_run
    from tiermoe.cli.main import parse_command

    run, args = parse_command(["stats", "no-such-file.csv"])  # a missing file is an error of the run, not yet
    assert run is stats_run.run and args.files == ["no-such-file.csv"]
    assert parse_command([]) is None
