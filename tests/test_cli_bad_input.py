"""Bad values in flags and files give one line (`error: ...`, status 2), never a traceback: plans, file-path flags,
numbers that are not finite or do not fit, statistics with impossible counts, files that are not traces."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from conftest import run_cli

from tiermoe.config import PlacementConfig
from tiermoe.errors import TiermoeError
from tiermoe.placement.plan import PlacementPlan
from tiermoe.placement.planner import PlacementTarget, make_plan
from tiermoe.stats.io import load_counts, load_stats

SHAPE = ("--num-layers", "4", "--num-experts", "4")
MISSING_MODEL = ("--model", "/nonexistent/model")  # fails at once on code that checks flags only when it runs


def assert_one_line_error(result, fragment: str) -> None:
    """Status 2, no traceback, exactly one line saying `error:` (ours or argparse's), and it names the problem."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and fragment in lines[0], result.stderr


@pytest.fixture
def plan_file(tmp_path):
    def write(**changes) -> str:
        data = PlacementPlan(torch.tensor([[0, -1], [-1, 0]])).to_dict()
        data.update(changes)
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(data))
        return str(path)

    return write


@pytest.mark.parametrize("num_gpus", ["abc", None, 1.5, True, 0, [2]])
def test_a_plan_whose_num_gpus_is_not_a_positive_integer_is_refused(plan_file, num_gpus):
    result = run_cli("place", "--num-layers", "2", "--num-experts", "2", "--plan", plan_file(num_gpus=num_gpus))
    assert_one_line_error(result, "num_gpus")


@pytest.mark.parametrize("value", [0.9, 0.0, True, "0", None, 2**70])
def test_a_plan_assignment_must_hold_integers(plan_file, value):
    path = plan_file(assignment=[[value, -1], [-1, 0]])
    with pytest.raises(TiermoeError, match="assignment"):
        PlacementPlan.load(path)
    assert_one_line_error(run_cli("place", "--num-layers", "2", "--num-experts", "2", "--plan", path), "assignment")


def test_a_plan_with_wrongly_typed_fields_is_refused(plan_file):
    for field, value in [("strategy", 3), ("budget", [1]), ("gpu_split", 5), ("model_type", {})]:
        with pytest.raises(TiermoeError, match=field):
            PlacementPlan.load(plan_file(**{field: value}))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_gpu_memory_must_be_a_finite_number(value):
    assert_one_line_error(run_cli("place", *SHAPE, f"--gpu-memory-gb={value}"), "finite")
    with pytest.raises(TiermoeError, match="finite"):
        PlacementConfig(gpu_memory_gb=float(value))


@pytest.mark.parametrize("args, fragment", [
    (("generate", *MISSING_MODEL, "--prompt", "hi", "--temperature", "inf"), "finite"),
    (("generate", *MISSING_MODEL, "--prompt", "hi", "--gpu-prefill-buffer-gb", "nan"), "finite"),
    (("fit", "--model", "x", "--ram-gb", "inf"), "finite"),
    (("bench", "dynamic", "--trace", "t.pt", "--cpu-gflops", "0"), "> 0"),
    (("bench", "dynamic", "--trace", "t.pt", "--cpu-bandwidth-gbs", "nan"), "finite"),
    (("bench", "placement", "--dataset", "d", *MISSING_MODEL, "--tolerance", "nan"), "finite"),
    (("bench", "placement", "--dataset", "d", *MISSING_MODEL, "--heldout-fraction", "2"), "between 0"),
    (("bench", "placement", "--dataset", "d", *MISSING_MODEL, "--prefill-threshold", "-5"), ">= 0"),
    (("serve", *MISSING_MODEL, "--dist-timeout", "inf"), "finite"),
    (("serve", *MISSING_MODEL, "--page-size", "4096"), "at most 1024 tokens per page"),
    (("serve", *MISSING_MODEL, "--page-size", "0"), "--page-size"),
    (("make-model", "--arch", "qwen3_moe", "--out", "OUT", "--shard-gb", "nan"), "finite"),
    (("generate", *MISSING_MODEL, "--prompt", "hi", "--max-tokens", str(2**70)), "at most"),
])
def test_numeric_flags_refuse_values_that_are_not_finite_or_do_not_fit(tmp_path, args, fragment):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    assert_one_line_error(run_cli(*args), fragment)


@pytest.mark.parametrize("args", [
    ("place", *SHAPE, "--strategy", "random", "--num-gpu-experts", "1", "--seed"),
    ("place", *SHAPE, "--strategy", "random", "--num-gpu-experts", "1", "--placement-seed"),
    ("stats", "x.pt", "--placement-seed"),
    ("generate", *MISSING_MODEL, "--prompt", "hi", "--seed"),
    ("record", "--dataset", "d", "--num-prompts", "1", *MISSING_MODEL, "--seed"),
    ("bench", "placement", "--dataset", "d", *MISSING_MODEL, "--seed"),
    ("make-model", "--arch", "qwen3_moe", "--out", "OUT", "--seed"),
])
@pytest.mark.parametrize("seed", [str(2**64), "99999999999999999999999", "-1"])
def test_seeds_are_bounded_to_64_bits(tmp_path, args, seed):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    assert_one_line_error(run_cli(*args, seed), "seed")


def test_the_largest_seed_still_works():
    assert run_cli("place", *SHAPE, "--strategy", "random", "--num-gpu-experts", "1", "--seed",
                   str(2**64 - 1)).returncode == 0


@pytest.mark.parametrize("args", [
    ("place", *SHAPE, "--out"),
    ("place", *SHAPE, "--plot"),
    ("stats", "x.pt", "--plot"),
    ("bench", "dynamic", "--trace", "t.pt", "--plot"),
    ("bench", "placement", "--dataset", "d", *MISSING_MODEL, "--out"),
    ("bench", "placement", "--dataset", "d", *MISSING_MODEL, "--markdown"),
    ("bench", "placement", "--dataset", "d", *MISSING_MODEL, "--plot"),
])
def test_output_files_are_checked_before_any_work(tmp_path, args):
    missing = tmp_path / "missing" / "out.file"
    assert_one_line_error(run_cli(*args, str(missing)), f"'{missing.parent}' does not exist")
    assert_one_line_error(run_cli(*args, str(tmp_path)), "is a directory")
    assert not missing.parent.exists()


def test_record_creates_missing_directories_but_never_writes_onto_a_directory_or_below_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    record = ("record", "--dataset", "d", "--num-prompts", "1", *MISSING_MODEL, "--out")
    assert_one_line_error(run_cli(*record, str(tmp_path)), "is a directory")
    assert_one_line_error(run_cli(*record, str(tmp_path / "file" / "stats.pt")), "is not a directory")


def test_plots_are_written_in_a_format_matplotlib_knows(tmp_path):
    assert_one_line_error(run_cli("place", *SHAPE, "--plot", str(tmp_path / "plan.xyz")), "cannot draw")


def test_make_model_out_onto_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    assert_one_line_error(run_cli("make-model", "--arch", "qwen3_moe", "--out", str(tmp_path / "file")),
                          "not a directory")


def test_a_plan_write_that_fails_is_one_line(tmp_path):
    with pytest.raises(TiermoeError, match="cannot write the plan"):
        PlacementPlan(torch.tensor([[0]])).save(tmp_path)


@pytest.fixture
def counts(tmp_path):
    def write(name: str, values) -> str:
        path = tmp_path / f"{name}.pt"
        torch.save(torch.tensor(values, dtype=torch.float32), path)
        return str(path)

    return write


BAD_COUNTS = {"negative": ([[3.0, -1.0, 2.0, 0.0]] * 4, "negative"),
              "nan": ([[3.0, float("nan"), 2.0, 0.0]] * 4, "NaN"),
              "inf": ([[3.0, float("inf"), 2.0, 0.0]] * 4, "infinite")}


@pytest.mark.parametrize("kind", sorted(BAD_COUNTS))
def test_counts_that_are_negative_nan_or_infinite_are_refused(counts, kind):
    values, fragment = BAD_COUNTS[kind]
    path = counts(kind, values)
    with pytest.raises(TiermoeError, match=fragment):
        load_counts(path, 4, 4)
    with pytest.raises(TiermoeError, match=fragment):
        load_stats(path)
    assert_one_line_error(run_cli("stats", path), fragment)
    assert_one_line_error(run_cli("place", *SHAPE, "--strategy", "frequency", "--num-gpu-experts", "1",
                                  "--init-expert-location", path), fragment)


def test_counts_of_a_tiermoe_dump_are_checked_too(tmp_path):
    path = tmp_path / "dump.pt"
    torch.save({"format": "tiermoe-expert-distribution", "mode": "stat", "num_layers": 2, "num_experts": 2,
                "logical_count": torch.tensor([[[1, 2], [3, 4]]]),
                "logical_count_prefill": torch.tensor([[1, -2], [0, 0]]),
                "logical_count_decode": torch.tensor([[0, 4], [3, 4]])}, path)
    with pytest.raises(TiermoeError, match="negative"):
        load_stats(path)


def test_all_zero_counts_are_planned_with_a_warning_and_never_print_nan(counts):
    path = counts("zero", [[0.0] * 4] * 4)
    target = PlacementTarget(4, 4, (0, 1, 2, 3))
    with pytest.warns(UserWarning, match="all zero"):
        plan = make_plan(PlacementConfig("frequency", num_gpu_experts=1), target, load_counts(path, 4, 4))
    assert torch.equal(plan.assignment, make_plan(PlacementConfig(num_gpu_experts=1), target).assignment)
    result = run_cli("place", *SHAPE, "--strategy", "frequency", "--num-gpu-experts", "1",
                     "--init-expert-location", path)
    assert result.returncode == 0, result.stderr
    assert "warning:" in result.stderr and "all zero" in result.stderr
    assert "nan" not in result.stdout.lower() and "0.0%" not in result.stdout  # no hit rate of nothing
    for args in ((path,), (counts("zero2", [[0.0] * 4] * 4), "--json")):  # another name: a warning shows once
        result = run_cli("stats", *args)
        assert result.returncode == 0, result.stderr
        assert "warning:" in result.stderr and "all zero" in result.stderr
        assert "nan" not in result.stdout.lower()
        assert "hit rate" not in result.stdout and "hit_rates" not in result.stdout


def test_hit_rates_on_all_zero_held_out_counts_are_not_printed(counts):
    good = counts("good", [[3.0, 1.0, 2.0, 0.0]] * 4)
    zero = counts("zero", [[0.0] * 4] * 4)
    result = run_cli("stats", good, "--eval", zero)
    assert result.returncode == 0, result.stderr
    assert "nan" not in result.stdout.lower() and "hit rate" not in result.stdout
    assert "all zero" in result.stderr


def _trace(**changes):
    trace = {"token_pass": torch.tensor([0, 1]), "topk_ids": torch.tensor([[[1, 2]], [[0, 3]]]),
             "token_is_prefill": torch.tensor([True, False]), "moe_layers": [0], "num_layers": 1, "num_experts": 4}
    trace.update(changes)
    return trace


@pytest.mark.parametrize("content, fragment", [
    (torch.zeros(3), "not a per_token trace"),
    (torch.zeros(4, 4), "not a per_token trace"),
    ([1, 2], "not a per_token trace"),
    ({"a": 1}, "missing 'token_pass'"),
    (_trace(token_pass="x"), "token_pass"),
    (_trace(topk_ids=torch.tensor([1, 2])), "topk_ids"),
    (_trace(topk_ids=torch.tensor([[[1, 2]], [[0, 9]]])), "topk_ids"),
    (_trace(topk_ids=torch.tensor([[[1, 2], [1, 2]], [[0, 3], [1, 2]]])), "moe_layers"),
    (_trace(token_pass=torch.tensor([0, 1, 2])), "token_pass"),
    (_trace(token_pass=torch.tensor([0.5, 1.0])), "token_pass"),
    (_trace(token_request=torch.tensor([0, 1, 2])), "token_request"),
    (_trace(token_request=torch.tensor([0.5, 1.0])), "token_request"),
    (_trace(moe_layers=[5]), "moe_layers"),
    (_trace(num_experts="four"), "num_experts"),
    (_trace(num_experts=-4), "num_experts"),
])
def test_bench_dynamic_on_a_file_that_is_not_a_trace(tmp_path, content, fragment):
    path = tmp_path / "t.pt"
    torch.save(content, path)
    assert_one_line_error(run_cli("bench", "dynamic", "--trace", str(path)), fragment)


def test_bench_dynamic_on_a_file_torch_cannot_read(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{}")
    result = run_cli("bench", "dynamic", "--trace", str(path))
    assert_one_line_error(result, "cannot load trace")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("url, fragment", [("http://[::1", "not a URL"), ("notaurl", "expected http://"),
                                           ("ftp://x", "expected http://")])
def test_chat_url_is_checked_before_the_chat_starts(url, fragment):
    result = run_cli("chat", "--url", url)
    assert_one_line_error(result, fragment)
    assert "you>" not in result.stdout


@pytest.mark.parametrize("changes, fragment", [
    ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 0}, "top_k"),
    ({"num_local_experts": -4}, "num_experts"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_a_config_with_impossible_moe_sizes_is_refused(tiny_dir, tmp_path, changes, fragment):
    model, good = tmp_path / "model", tiny_dir("qwen3_moe")
    model.mkdir()
    for weights in good.glob("*.safetensors"):
        (model / weights.name).symlink_to(weights)
    config = json.loads((good / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    assert_one_line_error(run_cli("inspect", str(model)), fragment)


@pytest.mark.parametrize("content", ["[1, 2]", '{"memory_bandwidth": -1, "compute_flops": 1, "pcie_bandwidth": 1}',
                                     '{"memory_bandwidth": 1e400, "compute_flops": 1, "pcie_bandwidth": 1}', "null"])
def test_a_gpu_profile_file_that_is_not_a_profile_is_refused(tmp_path, content):
    profile = tmp_path / "profile.json"
    profile.write_text(content)
    result = run_cli("bench", "dynamic", "--trace", str(tmp_path / "t.pt"), "--gpu-profile", str(profile))
    assert_one_line_error(result, "GPU profile")


def test_serve_refuses_a_host_or_port_it_cannot_listen_on_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert_one_line_error(run_cli("serve", "--port", port), f"port {port} on 127.0.0.1 is in use")
    assert_one_line_error(run_cli("serve", "--host", "no-such-host.invalid", "--allowed-hosts", "*"),
                          "--host 'no-such-host.invalid'")
