"""Flag and file values that size a resource (processes, threads, memory) are bounded by what the machine has,
with one line saying so, before anything is started or allocated."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from conftest import run_cli
from test_cli_bad_input import MISSING_MODEL, assert_one_line_error

from tiermoe import config
from tiermoe.config import CPUConfig, ServerConfig
from tiermoe.engine.engine import EngineConfig
from tiermoe.errors import TiermoeError
from tiermoe.placement import free_memory
from tiermoe.placement.plan import PlacementPlan
from tiermoe.placement.planner import PlacementTarget


@pytest.fixture
def two_cpus(monkeypatch):
    """A machine with 2 CPUs and no CUDA device, whatever runs the test."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_serve_num_gpus_on_the_cpu_is_bounded_by_the_cores(two_cpus):
    result = run_cli("serve", *MISSING_MODEL, "--gpu-device", "cpu", "--num-gpus", "64")
    assert_one_line_error(result, "--num-gpus 64 starts 64 ranks, but this machine has 2 CPUs")


def test_serve_num_gpus_on_cuda_is_bounded_by_the_devices(two_cpus):
    result = run_cli("serve", *MISSING_MODEL, "--gpu-device", "cuda", "--num-gpus", "2")
    assert_one_line_error(result, "--num-gpus 2 starts 2 ranks, one per GPU, but this machine has 0 CUDA devices")


def test_a_plans_num_gpus_is_bounded_too(two_cpus, tmp_path):
    PlacementPlan(torch.full((2, 4), -1), num_gpus=1000).save(tmp_path / "plan.json")
    result = run_cli("serve", *MISSING_MODEL, "--plan", str(tmp_path / "plan.json"))
    assert_one_line_error(result, "the plan's num_gpus 1000 starts 1000 ranks, but this machine has 2 CPUs")


def test_ranks_started_by_torchrun_are_bounded_per_node(two_cpus, monkeypatch):
    for key, value in {"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    result = run_cli("serve", *MISSING_MODEL, "--num-gpus", "8")
    assert_one_line_error(result, "4 ranks run on this node, but this machine has 2 CPUs")


def test_cpu_threads_are_bounded_by_the_cores(two_cpus):
    with pytest.raises(TiermoeError, match="cpu threads 100000: this machine has 2 CPUs; at most 8"):
        CPUConfig(threads=100000)
    assert CPUConfig(threads=8).threads == 8  # a few per core are allowed (tests and latency hiding use them)
    for flag in ("--cpu-threads", "--kt-cpuinfer"):
        result = run_cli("generate", *MISSING_MODEL, "--prompt", "hi", flag, "20000")
        assert_one_line_error(result, "20000: this machine has 2 CPUs")


def test_place_refuses_a_shape_no_model_has(two_cpus):
    assert_one_line_error(run_cli("place", "--num-layers", "100000", "--num-experts", "100000"),
                          "100000 layers x 100000 experts")
    with pytest.raises(TiermoeError, match="layers x"):
        PlacementTarget(100000, 100000, (0,))
    assert PlacementTarget(61, 256, tuple(range(3, 61))).num_experts == 256  # DeepSeek-V3


def test_place_refuses_a_shape_larger_than_the_available_memory(two_cpus, monkeypatch):
    from tiermoe.cli import place_run

    monkeypatch.setattr(place_run, "available_ram", lambda: 10 * 2**20)
    assert_one_line_error(run_cli("place", "--num-layers", "1000", "--num-experts", "1000"), "available")


def test_place_refuses_an_absurd_gpu_count():
    assert_one_line_error(run_cli("place", "--num-layers", "4", "--num-experts", "4", "--num-gpu-experts", "2",
                                  "--num-gpus", "100000"), "num_gpus")


def test_place_moe_layer_ranges_are_checked_before_they_are_built():
    assert_one_line_error(run_cli("place", "--num-layers", "4", "--num-experts", "4", "--moe-layers",
                                  "0-100000000000"), "not a range within 0..3")


def test_make_model_layers_are_bounded(tmp_path):
    assert_one_line_error(run_cli("make-model", "--arch", "qwen3_moe", "--layers", "1000000000", "--out",
                                  str(tmp_path / "m")), "at most 128 layers")
    assert_one_line_error(run_cli("make-model", "--arch", "qwen3_moe", "--preset", "qwen3-30b-a3b", "--layers", "49",
                                  "--out", str(tmp_path / "m")), "preset qwen3-30b-a3b has 48 layers")
    assert not (tmp_path / "m").exists()


def test_a_recorder_buffer_larger_than_memory_is_refused():
    result = run_cli("generate", "--prompt", "hi", "--expert-distribution-recorder-mode", "per_pass",
                     "--expert-distribution-recorder-buffer-size", str(10**15))
    assert_one_line_error(result, "GiB available")


def _serve_config(*flags: str) -> ServerConfig:
    from tiermoe.cli.serve_flags import add_serve_flags, server_config_from_args

    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return server_config_from_args(parser.parse_args(list(flags)))


def test_max_running_requests_is_bounded_by_the_kv_cache_it_needs():
    assert_one_line_error(run_cli("serve", *MISSING_MODEL, "--max-running-requests", "5000"),
                          "argument --max-running-requests: expected at most 4096 sequences at once")
    assert_one_line_error(run_cli("serve", *MISSING_MODEL, "--max-running-requests", "100",
                                  "--max-total-tokens", "100"),
                          "--max-running-requests 100: --max-total-tokens 100 holds at most 50 running requests (each "
                          "holds at least 2 tokens of KV cache)")
    with pytest.raises(TiermoeError, match="--max-running-requests 5000: at most 4096 requests run at once"):
        ServerConfig(max_running_requests=5000)
    with pytest.raises(TiermoeError, match="max_running must be 1-4096 sequences, got 5000"):
        EngineConfig(max_running=5000)
    assert _serve_config().max_running_requests == 32
    assert _serve_config("--max-total-tokens", "40").max_running_requests == 20  # the default follows the budget


def test_requests_in_flight_are_bounded_by_the_open_file_limit(monkeypatch):
    monkeypatch.setattr(config, "open_files_limit", lambda: 512)  # 256 of them for connections
    assert (ServerConfig().queue_limit, ServerConfig().in_flight_limit) == (128, 160)  # 4 batches by default
    assert ServerConfig(max_running_requests=200).queue_limit == 56  # the default shrinks to what the files allow
    assert ServerConfig(max_queued_requests=0).in_flight_limit == 32
    assert_one_line_error(run_cli("serve", *MISSING_MODEL, "--max-queued-requests", "1000"),
                          "--max-queued-requests: 1032 requests in flight hold as many connections, but this process "
                          "may open 512 files (ulimit -n), 256 of them kept for the rest: at most 256 in flight")
    assert_one_line_error(run_cli("serve", *MISSING_MODEL, "--max-running-requests", "300"),
                          "--max-running-requests: 300 requests in flight")
    assert_one_line_error(run_cli("serve", *MISSING_MODEL, "--max-queued-requests", "-1"),
                          "argument --max-queued-requests: expected an integer >= 0")


def test_record_batch_size_is_bounded_by_the_kv_cache_it_needs(monkeypatch):
    record = ("record", "--dataset", "missing.jsonl", "--num-prompts", "1")
    assert_one_line_error(run_cli(*record, "--batch-size", "5000"),
                          "argument --batch-size/--max-running: expected at most 4096 sequences at once")
    monkeypatch.setattr(free_memory, "available_ram", lambda: 2**20)
    assert_one_line_error(run_cli(*record, "--batch-size", "4096"),
                          "--batch-size 4096: each running sequence holds at least 2 tokens of KV cache")
