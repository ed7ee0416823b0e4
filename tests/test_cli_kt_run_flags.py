"""The flags `kt run` puts on SGLang-kt launch lines work with `tiermoe serve`: --kt-numa-nodes pins the CPU tier's
thread pools per node (on a fake two-node machine), --watchdog-timeout stops a server whose step hangs,
--enable-expert-distribution-metrics feeds /metrics, --kt-max-deferred-experts-per-token reaches the CPU tier's
settings (a bad value is one line), --fp8-gemm-backend is noted."""

from __future__ import annotations

import argparse
import io
import logging

import httpx
import pytest
import torch
from conftest import run_cli
from server_thread import server_thread

import tiermoe.experts.threads as threads
from tiermoe.cli.cpu_flags import cpu_from_args
from tiermoe.cli.serve_flags import add_serve_flags, server_config_from_args
from tiermoe.cli.sglang_flags import report_ignored
from tiermoe.experts.ffn import ExpertActivation
from tiermoe.experts.native import NativeCPUExperts
from tiermoe.experts.tiers import CPUWorker
from tiermoe.server.engine_service import StuckStepError

KT_RUN_LINE = ["--kt-max-deferred-experts-per-token", "2", "--kt-threadpool-count", "2", "--kt-numa-nodes", "0", "1",
               "--watchdog-timeout", "3000", "--enable-expert-distribution-metrics", "--fp8-gemm-backend", "triton",
               "--kt-cpuinfer", "2"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return parser.parse_args(list(argv))


def test_every_kt_run_flag_parses_into_the_settings():
    args = parse(*KT_RUN_LINE)
    config = server_config_from_args(args)
    assert config.watchdog_timeout == 3000 and config.expert_distribution_metrics
    assert cpu_from_args(args).numa_nodes == (0, 1) and cpu_from_args(args).deferred_experts == 2
    assert cpu_from_args(parse()).deferred_experts == 0
    assert parse("--kt-numa-nodes", "0 1").numa_nodes == [0, 1] == parse("--kt-numa-nodes", "0,1").numa_nodes
    note = io.StringIO()
    report_ignored(args, note)
    assert note.getvalue().count("\n") == 1 and "--fp8-gemm-backend triton (" in note.getvalue()


def test_bad_deferred_experts_and_mismatched_pools_are_one_line():
    result = run_cli("serve", "--kt-max-deferred-experts-per-token", "-1")
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2 and len(lines) == 1 and "expected an integer >= 0, got -1" in lines[0]
    result = run_cli("serve", "--kt-numa-nodes", "0", "1", "--kt-threadpool-count", "3")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: --kt-numa-nodes lists 2 nodes but --kt-threadpool-count is 3: give one node per pool (as SGLang-kt "
        "requires)"]


@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    """A fake machine: 2 sockets = 2 NUMA nodes, 4 cores each, 2 SMT siblings per core (CPUs 0-15)."""
    for cpu in range(16):
        topo = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{(cpu % 8) // 4}\n")
        (topo / "core_id").write_text(f"{cpu % 4}\n")
    for node, cpus in ((0, "0-3,8-11"), (1, "4-7,12-15")):
        (tmp_path / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    monkeypatch.setattr(threads, "SYSFS", tmp_path)
    monkeypatch.setattr(threads, "allowed_cpus", lambda: list(range(16)))
    monkeypatch.delenv("TIERMOE_CPU_PIN", raising=False)


def test_numa_pools_take_the_last_physical_cores_of_their_nodes(two_nodes, monkeypatch):
    assert threads.numa_nodes() == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    assert threads.pool_sizes(5, 2) == [3, 2]
    assert threads.numa_team_cpus(6, [0, 1]) == [1, 2, 3, 5, 6, 7]
    assert threads.numa_team_cpus(5, [0, 1]) == [1, 2, 3, 6, 7]
    assert threads.numa_team_cpus(4, [0, 0]) == [0, 1, 2, 3]  # two pools on one node: distinct cores
    assert threads.numa_team_cpus(3, [1]) == [5, 6, 7]
    for n, nodes, fragment in ((4, [0, 2], "no NUMA node 2"), (10, [0, 1], "node 0 has 4 physical cores for 5"),
                               (1, [0, 1], "every pool needs a thread")):
        with pytest.raises(Exception, match=fragment):
            threads.numa_team_cpus(n, nodes)
    monkeypatch.setenv("TIERMOE_CPU_PIN", "0")
    assert threads.numa_team_cpus(4, [0, 1]) == []


def test_the_native_tier_pins_its_team_per_node(two_nodes, monkeypatch):
    made = []

    class FakeTeam:
        def __init__(self, kernels, n, cpus):
            made.append((n, list(cpus)))

    monkeypatch.setattr("tiermoe.experts.native.ThreadTeam", FakeTeam)
    worker = CPUWorker()
    tier = NativeCPUExperts(worker, ExpertActivation("silu_glu"), "bf16", torch.float32, threads=4,
                            numa_nodes=(0, 1))
    tier._team()
    assert made == [(4, [2, 3, 6, 7])]


def test_a_node_this_machine_lacks_is_refused_before_loading():
    result = run_cli("generate", "--prompt", "hi", "--kt-numa-nodes", "63", "--cpu-backend", "native",
                     "--cpu-expert-dtype", "bf16")
    assert result.returncode == 2 and "no NUMA node 63 on this machine" in result.stderr


def test_the_watchdog_stops_a_server_whose_step_hangs(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="tiermoe"):
        with server_thread(tmp_path, step_sleep=1.5, watchdog_timeout=0.3) as (url, state):
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert r.status_code == 500 and "--watchdog-timeout 0.3" in r.json()["error"]["message"]
            assert isinstance(state.service.fatal_error, StuckStepError)
            later = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert later.status_code == 500
    assert [r.message for r in caplog.records if "watchdog" in r.message]


def test_expert_distribution_metrics_count_every_routed_pair(tmp_path):
    with server_thread(tmp_path, expert_distribution_metrics=True) as (url, state):
        prompt = state.llm.encode("hello")
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        text = httpx.get(url + "/metrics").text
    spec = state.llm.hybrid.spec
    pairs = (len(prompt) + 3 - 1) * spec.top_k  # every prompt token and each generated token but the last
    values = {}
    for line in text.splitlines():
        if line.startswith("tiermoe_expert_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for layer in spec.moe_layers:
        assert values[f'tiermoe_expert_routed_pairs_total{{layer="{layer}"}}'] == pairs
        assert 0 <= values[f'tiermoe_expert_gpu_tier_pairs_total{{layer="{layer}"}}'] <= pairs
        assert 0 < values[f'tiermoe_expert_balancedness{{layer="{layer}"}}'] <= 1
        assert 1 <= values[f'tiermoe_expert_active_experts{{layer="{layer}"}}'] <= spec.num_experts
    assert len([k for k in values if k.startswith("tiermoe_expert_routed_pairs_total")]) == len(spec.moe_layers)
