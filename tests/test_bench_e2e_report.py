"""benchmarks/e2e/report.py: bench_e2e_cpu.py's derived figures and goal verdicts (pure logic; no llama.cpp)."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from e2e.report import (  # noqa: E402
    NO_REPACK,
    evaluate_goals,
    host_us_per_layer,
    keep_round,
    paired_floor_share,
    report,
)

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


def test_time_outside_the_kernels_per_layer_is_the_measured_figure_never_one_derived_from_the_floor():
    # 10 ms a step of which 6 ms inside the kernel library: 4 ms outside over 2 layers
    profiled = {"decode_tok_s": 100.0, "components_ms": {"step": 10.0, "native": 6.0, "outside_native": 4.0}}
    assert host_us_per_layer(profiled, 2) == pytest.approx(2000)
    assert host_us_per_layer({"decode_tok_s": 100.0, "bytes_per_token": 0.1 * GB}, 2) is None  # not profiled


def test_goals_judged_against_llama_cpp_with_their_figures():
    # floor: 20 GB/s / 0.5 GB = 40 tok/s; llama.cpp at 24 tok/s reads at 60% of it, so the ratio is judged
    ours = {"decode_tok_s": 36.0, "ttft16_s": 0.050, "prefill512_tok_s": 1680.0, "bytes_per_token": 0.5 * GB}
    theirs = {"decode_tok_s": 24.0, "ttft16_s": 0.050, "prefill512_tok_s": 800.0, "bytes_per_token": 0.5 * GB}
    results = _results(ours, theirs)
    decode = _goal(results, "bf16 decode")
    assert decode.reached is True and "1.50x" in decode.measured
    assert _goal(results, "time to first token").reached is True  # 1.0x <= 1.0x
    prefill = _goal(results, "prefill 512")
    assert prefill.reached is True and "2.10x" in prefill.measured  # 1680 / 800 >= 2
    theirs["ttft16_s"] = 0.045
    assert _goal(results, "time to first token").reached is False  # 1.11x llama.cpp's
    assert _goal(results, "decode >= 85%").reached is True  # 36 of 40 tok/s: 90%
    ours["decode_tok_s"] = 32.0  # 80% of the floor, still 1.33x llama.cpp
    assert _goal(results, "decode >= 85%").reached is False and _goal(results, "bf16 decode").reached is True


def test_the_ratio_is_not_judged_where_llama_cpp_reads_near_the_floor():
    # llama.cpp at 32 of 40 tok/s (80% of the floor): 1.1x of it is not judged; the floor goal judges the row
    results = _results({"decode_tok_s": 35.2, "bytes_per_token": 0.5 * GB},
                       {"decode_tok_s": 32.0, "bytes_per_token": 0.5 * GB})
    decode = _goal(results, "bf16 decode")
    assert decode.reached is None and "not judged: llama.cpp at 80% of the floor" in decode.measured
    assert _goal(results, "decode >= 85%").reached is True  # 88%


def test_the_thin_model_is_judged_on_the_ratio_alone():
    # 48 layers, weights in cache: faster than its "floor" means nothing there; 1000 against 1000 tok/s is 1.0x
    ours, theirs = {"decode_tok_s": 1000.0, "bytes_per_token": 1e3}, {"decode_tok_s": 1000.0, "bytes_per_token": 1e3}
    results = _results(ours, theirs, layers=48, host_bound=True)
    decode = _goal(results, "bf16 decode")
    assert decode.reached is False and "1.00x" in decode.measured
    assert not any(g.words.startswith("decode >= 85%") for g in evaluate_goals(results))


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
    assert _goal(results, "decode >= 85%").reached is False  # 50 tok/s of a 200 tok/s floor: needs no llama.cpp
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


def test_the_paired_floor_share_takes_each_round_at_the_rate_probed_in_it():
    # 1 GB a token: 10 tok/s at 20 GB/s is half the floor, 10 tok/s at 10 GB/s all of it; the median of the rounds
    figures = {}
    for decode in (10.0, 10.0, 15.0):
        keep_round(figures, {"decode_tok_s": decode})
    figures["bytes_per_token"] = 1 * GB
    assert paired_floor_share(figures, [20 * GB, 10 * GB, 30 * GB]) == pytest.approx(0.5)
    assert paired_floor_share(figures, [10 * GB, None]) == pytest.approx(1.0)  # a round without a probe is left out
    assert paired_floor_share(figures, None) is None and paired_floor_share({"decode_tok_s": 5.0}, [GB]) is None
    results = _results(figures, None)
    results["rows"][0]["round_read_rates"] = [20 * GB, 10 * GB, 30 * GB]
    assert "| 10.0 (10.0-15.0) | - | 50% | 50% |" in report(results)  # the run's best probe (20 GB/s): 50% too


def test_the_batched_figure_is_the_bound_of_the_step_over_its_time():
    # 8 sequences: 0.2 GB read at least per step at 20 GB/s is a 10 ms bound; steps of 12.4 ms reach 81% of it
    rounds = [{"step_s": s, "bytes": 0.2 * GB, "experts_per_layer": 50.0} for s in (0.0124, 0.011, 0.030)]
    results = _results({"decode_tok_s": 50.0, "batched_rounds": rounds}, None)
    goal = _goal(results, "8 sequences together")
    assert goal.reached is True and "81%" in goal.measured
    assert "| m | bf16 | tiermoe | 12.4 (11.0-30.0) | 50.0 | 200 | 10.0 | 81% |" in report(results)
    rounds[0]["step_s"] = rounds[1]["step_s"] = 0.02  # the median step is 20 ms: 50%
    assert _goal(results, "8 sequences together").reached is False


def test_a_failed_llama_cpp_side_falls_back_to_the_same_file_without_repacking_and_says_so():
    from bench_e2e_cpu import without_repacking

    side = ("llama.cpp", "llama.cpp", {"path": "m.gguf", "threads": 2, "context": 600}, None, 10, 10)
    fallback = without_repacking(side)
    assert fallback == ("llama.cpp", "llama.cpp", {"path": "m.gguf", "threads": 2, "context": 600, "repack": False},
                        None, 10, 10)
    assert without_repacking(fallback) is None  # no second fallback: then the side is dropped, with its error
    assert without_repacking(("tiermoe", "tiermoe", {"path": "hf"}, None, 10, 10)) is None
    results = _results({"decode_tok_s": 50.0}, {"decode_tok_s": 40.0, "path": NO_REPACK})
    assert f"| m | bf16 | llama.cpp ({NO_REPACK}) | 40.0 |" in report(results)
    assert _goal(results, "bf16 decode").reached is True  # still the llama.cpp the ratios are taken against
