"""benchmarks/e2e/report.py: bench_e2e_cpu.py's derived figures and goal verdicts (pure logic; no llama.cpp)."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from e2e.report import evaluate_goals, host_us_per_layer, keep_round, report  # noqa: E402

GB = 1e9


def _results(ours: dict, theirs: dict | None, layers: int = 2, loss: list | None = None,
             host_bound: bool = False) -> dict:
    backends = {"tiermoe": ours}
    if theirs is not None:
        backends["llama.cpp"] = theirs
    return {"machine": {"read_bandwidth": 20 * GB},
            "rows": [{"model": "m", "format": "bf16", "layers": layers, "backends": backends,
                      "host_bound": host_bound}],
            "loss": loss or []}


def _goal(results: dict, start: str):
    return next(g for g in evaluate_goals(results) if g.words.startswith(start))


def test_host_time_per_layer_is_the_step_beyond_its_bytes():
    # 100 tok/s = 10 ms a step; 0.1 GB at 20 GB/s = 5 ms of reading; the other 5 ms over 2 layers
    assert host_us_per_layer({"decode_tok_s": 100.0, "bytes_per_token": 0.1 * GB}, 20 * GB, 2) == pytest.approx(2500)
    # a step faster than its floor has no host time left (never negative)
    assert host_us_per_layer({"decode_tok_s": 1000.0, "bytes_per_token": 0.1 * GB}, 20 * GB, 2) == 0.0
    assert host_us_per_layer({}, 20 * GB, 2) is None


def test_goals_judged_against_llama_cpp_with_their_figures():
    ours = {"decode_tok_s": 50.0, "ttft16_s": 0.060, "prefill512_tok_s": 900.0, "bytes_per_token": 0.5 * GB}
    theirs = {"decode_tok_s": 40.0, "ttft16_s": 0.050, "prefill512_tok_s": 800.0, "bytes_per_token": 0.5 * GB}
    results = _results(ours, theirs)
    decode = _goal(results, "bf16 decode")
    assert decode.reached is True and "1.25x" in decode.measured
    assert _goal(results, "time to first token").reached is True  # 1.2x <= 1.5x
    prefill = _goal(results, "prefill 512")
    assert prefill.reached is False and "1.12x" in prefill.measured  # 900 / 800 < 1.2
    # floor: 20 GB/s / 0.5 GB = 40 tok/s; 50 tok/s is above it
    assert _goal(results, "decode >= 80%").reached is True
    # the host goal is judged on the host-bound model only (a wide model's step beyond its floor is not host time)
    assert not any(g.words.startswith("host time") for g in evaluate_goals(results))


def test_host_goal_on_the_host_bound_model_instead_of_the_floor():
    # 48 layers, 200 tok/s (5 ms a step) against 1000 tok/s (1 ms), bytes next to nothing: 5x the host time
    ours, theirs = {"decode_tok_s": 200.0, "bytes_per_token": 1e3}, {"decode_tok_s": 1000.0, "bytes_per_token": 1e3}
    results = _results(ours, theirs, layers=48, host_bound=True)
    host = _goal(results, "host time")
    assert host.reached is False and "5.00x" in host.measured
    assert not any(g.words.startswith("decode >= 80%") for g in evaluate_goals(results))


def test_a_goal_is_reached_only_when_every_row_meets_it():
    results = _results({"decode_tok_s": 50.0}, {"decode_tok_s": 40.0})
    slow = {"model": "m8", "format": "bf16", "layers": 8,
            "backends": {"tiermoe": {"decode_tok_s": 10.0}, "llama.cpp": {"decode_tok_s": 20.0}}}
    results["rows"].append(slow)
    goal = _goal(results, "bf16 decode")
    assert goal.reached is False
    assert "m bf16 1.25x" in goal.measured and "m8 bf16 0.50x" in goal.measured


def test_without_llama_cpp_the_comparisons_are_not_measured():
    results = _results({"decode_tok_s": 50.0, "ttft16_s": 0.06, "bytes_per_token": 0.1 * GB}, None)
    assert _goal(results, "bf16 decode").reached is None
    assert _goal(results, "prefill 512").reached is None
    assert _goal(results, "decode >= 80%").reached is False  # 50 tok/s of a 200 tok/s floor: needs no llama.cpp
    text = report(results)
    assert "not measured" in text and "| m | bf16 | tiermoe | 50.0 |" in text


def test_loss_goal_compares_each_4bit_change_against_its_own_bf16():
    loss = {"model": "m", "vocab": 151936, "tokens": 100, "tiermoe bf16": 11.90, "tiermoe 4-bit": 11.93,
            "llama.cpp bf16": 11.91, "llama.cpp Q4_K_M": 11.93}
    goal = _goal(_results({}, {}, loss=[loss]), "4-bit held-out loss")
    assert goal.reached is True  # +0.03 against +0.02: within the 0.01 margin
    loss["tiermoe 4-bit"] = 11.94
    goal = _goal(_results({}, {}, loss=[loss]), "4-bit held-out loss")
    assert goal.reached is False and "+0.0400 vs +0.0200" in goal.measured
    assert f"{math.log(151936):.4f}" in report(_results({}, {}, loss=[loss]))


def test_each_figure_is_the_median_of_the_rounds_with_its_spread_in_the_table():
    figures = {}
    for decode, ttft in ((10.0, 0.2), (5.0, 0.1), (7.0, 0.3), (30.0, 0.15), (6.0, 0.12)):
        keep_round(figures, {"decode_tok_s": decode, "ttft16_s": ttft, "prefill512_tok_s": 100.0})
    assert figures["decode_tok_s"] == 7.0 and figures["ttft16_s"] == 0.15  # one fast outlier moves nothing
    assert figures["spread"]["decode_tok_s"] == [5.0, 30.0] and len(figures["rounds"]["ttft16_s"]) == 5
    assert "| 7.0 (5.0-30.0) |" in report(_results(figures, {}))
