"""The adaptive policy's settings on the command line: generate / serve (`--placement-policy adaptive`), `bench
dynamic` and `bench placement` take the same --adaptive-* flags, they reach the policy, and bad values are one-line
errors (what the settings change in `bench placement`: tests/test_bench_placement_adaptive.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import run_cli, save_tiny
from test_analysis_trace_replay import COST, make_trace

from tiermoe.cli.adaptive_flags import adaptive_from_args
from tiermoe.cli.main import build_parser
from tiermoe.cli.placement_flags import dynamic_from_args
from tiermoe.config import AdaptiveSettings, DynamicPlacementConfig
from tiermoe.engine.dynamic import make_policy
from tiermoe.errors import TiermoeError

EVERY_FLAG = ("--no-adaptive-cross-layer", "--adaptive-prompt-weight", "0.25", "--adaptive-swap-z", "0",
              "--adaptive-settled-swap-z", "0.5", "--adaptive-z", "1.5", "--adaptive-half-life", "512",
              "--adaptive-recent-half-life", "4", "--adaptive-horizon", "128", "--adaptive-margin", "2",
              "--adaptive-max-swaps", "8", "--adaptive-replan-every", "3")
FROM_EVERY_FLAG = AdaptiveSettings(half_life_tokens=512, replan_every=3, horizon_tokens=128, margin=2.0,
                                   max_swaps_in_flight=8, z_score=1.5, recent_half_life_tokens=4, cross_layer=False,
                                   swap_z_score=0.0, settled_swap_z_score=0.5, prompt_evidence=True,
                                   prompt_weight=0.25)


def parsed(command: str, *argv: str):
    extra = ("--prompt", "x") if command == "generate" else ()
    return build_parser(command).parse_args([command, *extra, *argv])


def test_several_ranks_swap_across_layers_only_when_asked(caplog):
    unset = dynamic_from_args(parsed("serve", "--placement-policy", "adaptive"))
    asked = dynamic_from_args(parsed("serve", "--placement-policy", "adaptive", "--adaptive-cross-layer"))
    with caplog.at_level("INFO", logger="tiermoe.engine.dynamic"):
        assert make_policy(unset, 2, 8, COST).settings.cross_layer  # one process: on
        assert "ranks" not in caplog.text
        assert not make_policy(unset, 2, 8, COST, ranks=2).settings.cross_layer
        assert "adaptive placement on 2 ranks: swaps stay within each layer" in caplog.text
        assert make_policy(asked, 2, 8, COST, ranks=2).settings.cross_layer
        assert "adaptive placement on 2 ranks: cross-layer swaps on" in caplog.text


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_flag_reaches_the_adaptive_policy(command):
    config = dynamic_from_args(parsed(command, "--placement-policy", "adaptive", *EVERY_FLAG))
    assert config.policy == "adaptive" and config.adaptive == FROM_EVERY_FLAG
    policy = make_policy(config, 2, 8, COST)
    assert policy.settings == FROM_EVERY_FLAG
    on = dynamic_from_args(parsed(command, "--placement-policy", "adaptive", "--adaptive-cross-layer"))
    assert make_policy(on, 2, 8, COST).settings.cross_layer
    assert make_policy(on, 2, 8, COST, ranks=4).settings.cross_layer  # given: several ranks too
    assert not make_policy(config, 2, 8, COST, ranks=4).settings.cross_layer  # --no-adaptive-cross-layer


def test_without_flags_the_policy_keeps_its_defaults():
    config = dynamic_from_args(parsed("generate", "--placement-policy", "adaptive"))
    assert config.adaptive == AdaptiveSettings() == DynamicPlacementConfig().adaptive
    assert config.adaptive.cross_layer is None and make_policy(config, 2, 8, COST).settings.cross_layer
    assert not config.adaptive.prompt_evidence and config.adaptive.swap_z_score == 1
    alone = dynamic_from_args(parsed("generate", "--placement-policy", "adaptive", "--adaptive-prompt-evidence"))
    assert alone.adaptive.prompt_evidence and alone.adaptive.prompt_weight is None  # learned weight


@pytest.mark.parametrize("flag,value", [("--adaptive-prompt-weight", "1.5"), ("--adaptive-swap-z", "-1"),
                                        ("--adaptive-settled-swap-z", "x"), ("--adaptive-half-life", "0"),
                                        ("--adaptive-max-swaps", "0"), ("--adaptive-margin", "nan"),
                                        ("--adaptive-replan-every", "x")])
def test_a_bad_value_is_a_one_line_error(flag, value):
    result = run_cli("generate", "--prompt", "x", "--placement-policy", "adaptive", flag, value)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert flag in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,words", [
    (("--adaptive-swap-z", "0"), "--placement-policy adaptive"),  # adaptive settings for another policy
    (("--placement-policy", "adaptive", "--no-adaptive-prompt-evidence", "--adaptive-prompt-weight", "0.5"),
     "--adaptive-prompt-weight"),
])
def test_contradicting_flags_fail_before_the_model_loads(argv, words):
    result = run_cli("generate", "--prompt", "x", "--model", "/nonexistent/model", *argv)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0]


BENCH_PLACEMENT = ("bench", "placement", "--dataset", "d.jsonl", "--model", "/nonexistent/model")


@pytest.mark.parametrize("flag,value", [("--adaptive-prompt-weight", "2"), ("--adaptive-z", "-0.5"),
                                        ("--adaptive-horizon", "0"), ("--adaptive-max-swaps", "-1"),
                                        ("--adaptive-replan-every", "0")])
def test_bench_placement_refuses_a_bad_setting_in_one_line(flag, value):
    result = run_cli(*BENCH_PLACEMENT, flag, value)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert f"error: argument {flag}: expected " in last and last.endswith(f"got {value}")  # the value, not the flag


@pytest.mark.parametrize("argv,words", [
    (("--strategies", "uniform,frequency", "--adaptive-swap-z", "0"), "need adaptive in --strategies"),
    (("--no-adaptive-prompt-evidence", "--adaptive-prompt-weight", "0.5"), "--adaptive-prompt-weight"),
])
def test_bench_placement_refuses_contradicting_settings_before_the_model_loads(argv, words):
    result = run_cli(*BENCH_PLACEMENT, *argv)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0]


def test_bench_placement_takes_every_flag():
    args = build_parser("bench").parse_args([*BENCH_PLACEMENT, *EVERY_FLAG, "--adaptive-max-swaps", "0"])
    assert adaptive_from_args(args) == replace(FROM_EVERY_FLAG, max_swaps_in_flight=0)  # 0 allowed: a bench ablation


def test_the_library_refuses_bad_settings_in_one_line():
    for bad in ({"prompt_weight": 1.5}, {"swap_z_score": -1.0}, {"settled_swap_z_score": float("nan")},
                {"horizon_tokens": 0.0}, {"max_swaps_in_flight": -1}, {"recent_half_life_tokens": float("inf")}):
        with pytest.raises(TiermoeError) as err:
            AdaptiveSettings(**bad)
        assert next(iter(bad)) in str(err.value) and "\n" not in str(err.value)


def test_bench_dynamic_replays_adaptive_with_the_flags(tmp_path):
    torch.save(make_trace([(30, 4, [0, 1])]), tmp_path / "t.pt")
    torch.save(make_trace([(30, 4, [2, 3])], seed=3), tmp_path / "c.pt")
    model = save_tiny("olmoe", tmp_path / "m")
    common = ("bench", "dynamic", "--trace", str(tmp_path / "t.pt"), "--calibration", str(tmp_path / "c.pt"),
              "--model", str(model), "--ratios", "0.25", "--copy-budget", "2", "--json")

    def adaptive_of(*argv):
        result = run_cli(*common, *argv)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        return out["adaptive"], next(r for r in out["rows"] if r["policy"] == "adaptive")

    settings, row = adaptive_of()
    assert settings == dict(vars(AdaptiveSettings(max_swaps_in_flight=2, cross_layer=True)))  # --copy-budget
    assert row["swaps"] > 0
    settings, row = adaptive_of("--adaptive-max-swaps", "0", "--no-adaptive-cross-layer", "--adaptive-swap-z", "0.5")
    assert (settings["max_swaps_in_flight"], settings["cross_layer"], settings["swap_z_score"]) == (0, False, 0.5)
    assert row["swaps"] == 0 and row["bytes_copied"] == 0


@pytest.mark.parametrize("argv", [("generate",), ("serve",), ("bench", "dynamic"), ("bench", "placement")])
def test_help_shows_the_adaptive_flags_with_an_example(argv):
    result = run_cli(*argv, "--help")
    assert result.returncode == 0
    text = result.stdout
    assert "--no-adaptive-cross-layer" in text and "--adaptive-prompt-weight" in text
    examples = text.split("examples:")[1]
    assert "--adaptive-" in examples
