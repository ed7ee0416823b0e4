"""Several ranks on torch.distributed (gloo, gpu_device=cpu): the single-process model's results, one host copy of
the CPU experts, each rank exactly its plan share, and ranks that fail loudly instead of hanging.

The ranks are real processes: this file is also their program (`python tests/test_distributed.py MODE JOB`),
started with torchrun's environment by `spawn_ranks` (or by torchrun itself for the two-node test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import httpx
import pytest
import torch
from conftest import rel_err, save_char_tokenizer, save_tiny

FP32_TOL = 1e-5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34], [40]]
MAX_TOKENS = 8
WORKER = Path(__file__).resolve()
ROOT = WORKER.parent.parent


def input_ids() -> torch.Tensor:
    return torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))


def eager_adaptive():
    """Swap at the first sign of a difference, so a short run sees several swaps."""
    from tiermoe.config import AdaptiveSettings, DynamicPlacementConfig

    return DynamicPlacementConfig(policy="adaptive", adaptive=AdaptiveSettings(
        half_life_tokens=8, replan_every=1, margin=0.0, max_swaps_in_flight=2))


# --- the rank program ----------------------------------------------------------------------------------------
def _count_cpu_submits(hybrid) -> list[int]:
    calls = [0]
    for block in hybrid.blocks.values():
        submit = block.cpu_tier.submit

        def counted(*args, submit=submit, **kwargs):
            calls[0] += 1
            return submit(*args, **kwargs)

        block.cpu_tier.submit = counted
    return calls


def _holdings(rm) -> dict:
    hybrid = rm.hybrid
    return {
        "tier_bytes": [hybrid.tier_bytes().gpu_experts, hybrid.tier_bytes().cpu_experts],
        "gpu_tier": {str(layer): sorted(b.gpu_tier.experts) for layer, b in hybrid.blocks.items()},
        "cpu_tier": {str(layer): sorted(b.cpu_tier.experts) for layer, b in hybrid.blocks.items()},
        "rank_mask": hybrid.rank_mask.int().tolist(),
        "assignment": hybrid.assignment.tolist(),
        "cpu_thread": any(t.name.startswith("tiermoe-cpu-experts") for t in threading.enumerate()),
        "shm_bytes": rm.share.store.allocated_bytes() if rm.rank == 0 else None,
        "shm_slot_bytes": rm.share.store.slot_elems * 4 if rm.rank == 0 else None,
    }


def rank_main(mode: str, job_file: str) -> None:
    from tiermoe.config import CPUConfig
    from tiermoe.distributed import RankEnv, RankGroup, RankModel, rank_device
    from tiermoe.engine.sampling import SamplingParams
    from tiermoe.stats.tier_hits import TierHitCounter

    job = json.loads(Path(job_file).read_text())
    env = RankEnv.from_env()
    out = Path(job["out"])
    reports = []
    with RankGroup(env, rank_device(job.get("gpu_device", "cpu"), env), timeout_s=job["timeout"]) as group:
        for i, case in enumerate(job["cases"]):
            leads = group.rank == 0
            hits = TierHitCounter(case["num_layers"]) if leads else None
            dynamic = eager_adaptive() if case["dynamic"] and leads else None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rm = RankModel(group, case["path"], torch.tensor(case["assignment"]), dtype=torch.float32,
                               max_running=3, prefill_chunk=3, progress=False, dynamic=dynamic,
                               cpu=CPUConfig(expert_dtype=case["cpu_dtype"]), **({"recorder": hits} if leads else {}))
            with rm:
                submits = _count_cpu_submits(rm.hybrid)
                report = {"before": _holdings(rm), "warnings": [str(w.message) for w in caught]}
                logits = rm.hybrid(input_ids=input_ids()).logits  # every rank calls the model directly
                if leads:
                    torch.save(logits.cpu(), out / f"logits{i}.pt")
                if leads:
                    outs = rm.llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                    report["tokens"] = [o.token_ids for o in outs]
                    report["hits"] = [hits.pairs_L.tolist(), hits.gpu_pairs_L.tolist()]
                    report["swaps"] = rm.hybrid.swap_stats.swaps
                else:
                    report["steps"] = rm.follow()
                report["after"] = _holdings(rm)
                report["cpu_submits"] = submits[0]
            reports.append(report)
    (out / f"rank{env.rank}.json").write_text(json.dumps(reports))


# --- helpers of the tests --------------------------------------------------------------------------------------
def _spec(path):
    from tiermoe.arch import detect, load_config

    return detect(load_config(path))


def placements(spec) -> dict[str, torch.Tensor]:
    """Assignments [L, E] for 2 ranks, among them ones where a rank has no GPU expert in some or every layer."""
    L, E, moe = spec.num_layers, spec.num_experts, list(spec.moe_layers)
    half = torch.rand(L, E, generator=torch.Generator().manual_seed(5)) < 0.5
    from tiermoe.placement.partition import split_across_gpus

    out = {"random_half_round_robin": split_across_gpus(half & spec.moe_row_mask()[:, None], 2, "round-robin")}
    by_layer = torch.full((L, E), -1, dtype=torch.int64)
    by_layer[moe[0], :] = 0  # first MoE layer: all on rank 0, nothing on rank 1 nor on the CPU
    by_layer[moe[-1], 1:4] = 1  # last MoE layer: three experts on rank 1, none on rank 0, the rest on the CPU
    out["rank_per_layer"] = by_layer
    only_one = torch.full((L, E), -1, dtype=torch.int64)
    only_one[moe, 0:E:3] = 1  # rank 0 has no GPU expert at all
    out["all_gpu_experts_on_rank_1"] = only_one
    return out


def run_ranks(tmp_path: Path, cases: list[dict], world: int = 2, timeout: float = 30.0, launcher=None,
              wait_s: float = 300.0, gpu_device: str = "cpu", program: list[str] | None = None) -> list[list[dict]]:
    """Run the rank program on `cases` with `world` ranks; returns each rank's reports. `program`: the command
    that takes the job file's path (default: this file's equivalence mode); each rank writes rank<r>.json."""
    from tiermoe.distributed import spawn_ranks

    job = {"out": str(tmp_path), "timeout": timeout, "cases": cases, "gpu_device": gpu_device}
    (tmp_path / "job.json").write_text(json.dumps(job))
    argv = [*(program or [sys.executable, str(WORKER), "equivalence"]), str(tmp_path / "job.json")]
    procs = launcher(argv) if launcher else spawn_ranks(argv, world, stdout=subprocess.PIPE,
                                                        stderr=subprocess.STDOUT, text=True)
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=wait_s)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.gpu
def test_cuda_ranks_with_nccl_give_the_cpu_only_result(tmp_path_factory):
    """Where CUDA is at hand: 2 ranks with NCCL (or 1 CUDA rank on a one-GPU machine) against the CPU-only,
    single-process result. Unverified so far: no CUDA machine was available when this was written."""
    world = min(2, torch.cuda.device_count())
    if world == 0:
        pytest.skip("needs CUDA")
    path = save_tiny("deepseek_v3", tmp_path_factory.mktemp("cuda-model"))
    spec = _spec(path)
    assignment = placements(spec)["rank_per_layer"] if world == 2 else torch.where(
        placements(spec)["rank_per_layer"] >= 0, 0, -1)
    cases = [case(path, assignment), case(path, assignment, dynamic=True)]
    tmp = tmp_path_factory.mktemp("cuda")
    reports = run_ranks(tmp, cases, world=world, gpu_device="cuda")
    logits, tokens, _ = single_process(path, assignment)
    for i in range(len(cases)):
        assert rel_err(torch.load(tmp / f"logits{i}.pt"), logits) < 1e-4  # CUDA fp32 kernels, not bit-equal
        assert reports[0][i]["tokens"] == tokens


def case(path, assignment: torch.Tensor, dynamic: bool = False, cpu_dtype: str | None = None) -> dict:
    """cpu_dtype None: the torch CPU tier computes from the shared-memory slots; "bf16": the native backend
    converts each expert into its own packed copy (so the slots are released)."""
    return {"path": str(path), "assignment": assignment.tolist(), "num_layers": assignment.shape[0],
            "dynamic": dynamic, "cpu_dtype": cpu_dtype}


def single_process(path, assignment: torch.Tensor, cpu_dtype: str | None = None):
    """Logits, greedy tokens and GPU-tier hit counts of one process with the same experts on its GPU tier."""
    from tiermoe.config import CPUConfig
    from tiermoe.engine.llm import LLM
    from tiermoe.engine.sampling import SamplingParams
    from tiermoe.stats.tier_hits import TierHitCounter

    hits = TierHitCounter(assignment.shape[0])
    with LLM(path, placement=assignment >= 0, dtype=torch.float32, max_running=3, prefill_chunk=3,
             progress=False, recorder=hits, cpu=CPUConfig(expert_dtype=cpu_dtype)) as llm:
        logits = llm.hybrid(input_ids=input_ids()).logits
        tokens = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    return logits, tokens, [hits.pairs_L.tolist(), hits.gpu_pairs_L.tolist()]


def check_share(report: dict, rank: int, gpu_bytes_per_expert: int, bytes_per_expert: int,
                cpu_bytes_per_expert: int | None = None) -> None:
    """Rank `rank` holds exactly its plan share: its own GPU experts (`gpu_bytes_per_expert` each), and the CPU
    experts only on rank 0 (in their shared-memory slots of `bytes_per_expert`, unless the CPU backend converts
    them into its own copy: `cpu_bytes_per_expert`)."""
    a = torch.tensor(report["assignment"])
    assert torch.equal(torch.tensor(report["rank_mask"]).bool(), a == rank)  # sized to its own experts
    for layer, experts in report["gpu_tier"].items():
        assert experts == (a[int(layer)] == rank).nonzero().flatten().tolist()
    gpu_bytes, cpu_bytes = report["tier_bytes"]
    assert gpu_bytes == int((a == rank).sum()) * gpu_bytes_per_expert
    cpu_experts = int(sum((a[int(layer)] == -1).sum() for layer in report["cpu_tier"]))
    if rank == 0:
        assert cpu_bytes == cpu_experts * (cpu_bytes_per_expert or bytes_per_expert)
        for layer, experts in report["cpu_tier"].items():
            assert experts == (a[int(layer)] == -1).nonzero().flatten().tolist()
        in_slots = cpu_experts if cpu_bytes_per_expert is None else 0  # one host copy, nothing else kept
        assert report["shm_bytes"] == in_slots * report["shm_slot_bytes"]
    else:
        assert cpu_bytes == 0 and all(not e for e in report["cpu_tier"].values())


# --- the tests ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """One run of 2 ranks over several architectures and placements, and dynamic placement with both kinds of
    CPU tier; with the single-process results of the same placements."""
    from tiermoe.placement.partition import split_across_gpus

    cases, expected = [], []

    def add(path, name, assignment, dynamic=False, cpu_dtype=None):
        from tiermoe.fit import cpu_expert_bytes
        from tiermoe.model.gguf_checkpoint import open_checkpoint
        from tiermoe.model.held_bytes import gpu_expert_bytes

        spec = _spec(path)
        cases.append(case(path, assignment, dynamic, cpu_dtype))
        with open_checkpoint(path) as ckpt:  # a conversion cache: its source
            gpu = gpu_expert_bytes(ckpt, spec, torch.float32)  # FP8 checkpoints: as stored
        cpu_bytes = None if cpu_dtype is None else cpu_expert_bytes(spec, cpu_dtype, torch.float32)
        expected.append((spec.model_type, name, assignment, (gpu, spec.bytes_per_expert(torch.float32), cpu_bytes),
                         *single_process(path, assignment, cpu_dtype)))

    for arch in ("qwen3_moe", "deepseek_v3", "gpt_oss", "qwen2_moe"):
        path = save_tiny(arch, tmp_path_factory.mktemp(arch))
        items = placements(_spec(path))
        for name, assignment in items.items():
            if arch == "qwen3_moe" or name == "rank_per_layer":  # other archs: the uneven split only
                add(path, name, assignment)
    path = Path(cases[0]["path"])
    spec = _spec(path)
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    mask[list(spec.moe_layers), :3] = True
    three_per_layer = split_across_gpus(mask, 2, "round-robin")
    add(path, "dynamic", three_per_layer, dynamic=True)
    from tiermoe.config import CPU_BACKENDS

    if "native" in CPU_BACKENDS:  # the quantising CPU backend, where this tree has it
        add(path, "dynamic, native bf16 CPU tier", three_per_layer, dynamic=True, cpu_dtype="bf16")
        # a `tiermoe convert` cache: rank 0 maps its int8 experts instead of converting (swaps fill the slots)
        from tiermoe.convert import convert_cpu_experts

        cache = convert_cpu_experts(path, "int8", tmp_path_factory.mktemp("cache") / "int8", progress=False)
        add(cache, "dynamic, int8 conversion cache", three_per_layer, dynamic=True, cpu_dtype="int8")
    # FP8: GPU-tier experts stay FP8 on each rank; swaps requantise what arrives from the CPU tier's slots
    from tiermoe.testing.fp8_write import write_fp8_checkpoint

    add(write_fp8_checkpoint(path, tmp_path_factory.mktemp("fp8") / "m"), "dynamic, fp8", three_per_layer, dynamic=True)
    tmp = tmp_path_factory.mktemp("two-ranks")
    return tmp, run_ranks(tmp, cases), expected


def test_two_ranks_give_the_single_process_logits_and_tokens(two_rank_run):
    tmp, reports, expected = two_rank_run
    for i, (arch, name, *_, logits, tokens, _) in enumerate(expected):
        assert rel_err(torch.load(tmp / f"logits{i}.pt"), logits) < FP32_TOL, (arch, name)
        assert reports[0][i]["tokens"] == tokens, (arch, name)
        assert reports[1][i]["steps"] > 0


def test_each_rank_holds_its_plan_share_and_only_rank_0_runs_the_cpu_backend(two_rank_run):
    _, reports, expected = two_rank_run
    for i, (arch, name, assignment, bytes_per_expert, *_) in enumerate(expected):
        for rank in (0, 1):
            for when in ("before", "after"):
                check_share(reports[rank][i][when], rank, *bytes_per_expert)
        assert torch.equal(torch.tensor(reports[0][i]["before"]["assignment"]), assignment)
        has_cpu_experts = bool(((assignment == -1) & _moe_rows(assignment, reports[0][i])).any())
        assert (reports[0][i]["cpu_submits"] > 0) == has_cpu_experts, (arch, name)
        assert reports[0][i]["before"]["cpu_thread"] or reports[0][i]["after"]["cpu_thread"] or not has_cpu_experts
        assert reports[1][i]["cpu_submits"] == 0, (arch, name)  # exactly one process computes the CPU experts
        assert not reports[1][i]["after"]["cpu_thread"]


def _moe_rows(assignment, report) -> torch.Tensor:
    rows = torch.zeros(assignment.shape[0], dtype=torch.bool)
    rows[[int(layer) for layer in report["before"]["cpu_tier"]]] = True
    return rows[:, None]


def test_statistics_are_counted_once_with_the_global_gpu_tier(two_rank_run):
    """Routing is the same on every rank, so rank 0's recorder sees the global counts: not multiplied by 2."""
    _, reports, expected = two_rank_run
    for i, (arch, name, *_, hits) in enumerate(expected):
        if not name.startswith("dynamic"):  # a moving placement changes which tier serves a pair
            assert reports[0][i]["hits"] == hits, (arch, name)
        assert reports[0][i]["hits"][0] == hits[0], (arch, name)  # routed pairs: the same count in every case


def test_a_conversion_cache_is_mapped_by_the_rank_that_computes_the_cpu_tier(two_rank_run):
    _, reports, expected = two_rank_run
    found = [k for k, e in enumerate(expected) if "conversion cache" in e[1]]
    if not found:
        pytest.skip("the native CPU backend is not built on this machine")
    i = found[0]
    assert not [w for w in reports[0][i]["warnings"] if "cache" in w]  # mapped, not converted again
    assert reports[0][i]["swaps"] > 0


def test_swaps_across_ranks_keep_each_rank_to_its_own_experts(two_rank_run):
    _, reports, expected = two_rank_run
    for i in [k for k, e in enumerate(expected) if e[1].startswith("dynamic")]:
        assert reports[0][i]["swaps"] > 0
        before = torch.tensor(reports[0][i]["before"]["assignment"])
        after = [torch.tensor(reports[r][i]["after"]["assignment"]) for r in (0, 1)]
        assert torch.equal(after[0], after[1]) and not torch.equal(before, after[0])  # all ranks did every swap
        for rank in (0, 1):
            assert torch.equal((after[0] == rank).sum(dim=1), (before == rank).sum(dim=1))  # per-rank counts kept


def test_num_gpus_must_match_the_processes_started(monkeypatch, capsys, tmp_path):
    from tiermoe.placement.plan import PlacementPlan
    from tiermoe.serve import main

    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert main(["--model", str(tmp_path), "--num-gpus", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --num-gpus is 3 but 2 processes were started (one rank per GPU): pass --num-gpus 2, "
                   "or start 3 processes (torchrun --nproc-per-node 3)")
    PlacementPlan(torch.full((2, 4), -1), num_gpus=4).save(tmp_path / "plan.json")
    assert main(["--model", str(tmp_path), "--plan", str(tmp_path / "plan.json")]) == 2
    assert "the plan's num_gpus is 4 but 2 processes were started" in capsys.readouterr().err


def test_two_nodes_on_loopback_with_torchrun(tmp_path_factory):
    """`torchrun --nnodes 2`, launched twice: rank 1 is on another node, so it has no shared store and swaps
    read promoted experts from the checkpoint."""
    from tiermoe.distributed.launch import free_port
    from tiermoe.placement.partition import split_across_gpus

    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("nodes-model"))
    spec = _spec(path)
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    mask[list(spec.moe_layers), :3] = True
    assignment = split_across_gpus(mask, 2, "balanced")
    port = free_port()

    def two_launches(argv):
        torchrun = str(Path(sys.executable).parent / "torchrun")
        return [subprocess.Popen([torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                                  "--master-addr", "127.0.0.1", "--master-port", str(port), *argv[1:]],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for node in (0, 1)]

    tmp = tmp_path_factory.mktemp("nodes")
    reports = run_ranks(tmp, [case(path, assignment, dynamic=True)], launcher=two_launches)
    logits, tokens, _ = single_process(path, assignment)
    assert rel_err(torch.load(tmp / "logits0.pt"), logits) < FP32_TOL
    assert reports[0][0]["tokens"] == tokens
    assert reports[0][0]["swaps"] > 0
    assert torch.equal(torch.tensor(reports[0][0]["after"]["assignment"]),
                       torch.tensor(reports[1][0]["after"]["assignment"]))
    for rank in (0, 1):
        check_share(reports[rank][0]["after"], rank, *[spec.bytes_per_expert(torch.float32)] * 2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_two_ranks_use_one_process_memory_plus_at_most_1_gib(backend, tmp_path_factory):
    """A checkpoint with 4.9 GiB of CPU experts: total PSS of 2 ranks <= one process's PSS + 1 GiB (the benchmark
    benchmarks/bench_multi_rank_memory.py, whose results are in benchmarks/results/multi_rank.md). Set
    TIERMOE_MULTI_RANK_MODEL to reuse a checkpoint it made."""
    from tiermoe.config import CPU_BACKENDS

    if backend not in CPU_BACKENDS:
        pytest.skip(f"the {backend} CPU backend is not in this tree")
    model = os.environ.get("TIERMOE_MULTI_RANK_MODEL") or str(tmp_path_factory.getbasetemp() / "q30b-5l-v1k")
    out = tmp_path_factory.mktemp("pss") / "result.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_multi_rank_memory.py"), "--dir", model,
                    "--cpu-backend", backend, "--json", str(out)], check=True, timeout=1800)
    result = json.loads(out.read_text())
    single, ranks = result["single"], result["ranks"]
    assert single["cpu_experts"] >= 4 * 1024**3
    total = sum(r["rollup"]["Pss"] for r in ranks)
    assert total <= single["rollup"]["Pss"] + 1024**3
    assert [r["cpu_experts"] > 0 for r in ranks] == [True, False]  # one process holds the CPU tier


# --- serving ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("serve-model"))
    save_char_tokenizer(path)
    return path


def _completion(url: str, prompt: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 10,
                                                     "temperature": 0}, timeout=60)


def _shm_files(pid: int) -> list[Path]:
    return list(Path("/dev/shm").glob(f"tiermoe-experts-{pid}-*"))


def test_serve_with_num_gpus_launches_the_ranks_and_answers_like_one_process(chat_model):
    from tiermoe.config import PlacementConfig
    from tiermoe.engine.llm import LLM
    from tiermoe.engine.sampling import SamplingParams
    from tiermoe.testing.server_process import ServerProcess

    with LLM(chat_model, placement=PlacementConfig(num_gpu_experts=4), progress=False) as llm:
        expected = llm.generate("hello there", SamplingParams(max_tokens=10))[0].text
    timeout = 2.0
    server = ServerProcess(chat_model, "--num-gpus", "2", "--num-gpu-experts", "4", "--dist-timeout", str(timeout))
    try:
        time.sleep(2 * timeout)  # idle for longer than the collective timeout: heartbeats keep the ranks alive
        assert _completion(server.url, "hello there").json()["choices"][0]["text"] == expected
        assert _shm_files(server.proc.pid)  # rank 0's CPU experts, in shared memory
        followers = _children(server.proc.pid)
        assert len(followers) == 1
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
    assert not _shm_files(server.proc.pid)
    for pid in followers:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (FileNotFoundError, IndexError):
        return "gone"


def _start_ranks(model, timeout: float):
    from tiermoe.distributed import spawn_ranks
    from tiermoe.distributed.launch import free_port

    port = free_port()
    procs = spawn_ranks([sys.executable, "-m", "tiermoe.serve", "--model", str(model), "--port", str(port),
                         "--num-gpus", "2", "--num-gpu-experts", "4", "--dist-timeout", str(timeout)], 2,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return procs, url
        except httpx.HTTPError:
            time.sleep(0.2)
    for p in procs:
        p.kill()
    raise AssertionError("ranks did not come up:\n" + "\n".join(p.communicate()[0] for p in procs))


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_that_dies_makes_the_other_exit_with_a_clear_error(victim, chat_model):
    from tiermoe.distributed.shm_store import remove_stale_files

    timeout = 3.0
    procs, _ = _start_ranks(chat_model, timeout)
    try:
        procs[victim].send_signal(signal.SIGKILL)
        survivor = procs[1 - victim]
        start = time.monotonic()
        output = survivor.communicate(timeout=timeout + 30)[0]
        took = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert survivor.returncode == 2, output
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"error: rank {1 - victim}: ") and "died or stopped answering" in last, output
    assert took < timeout + 20
    if victim == 0:  # a killed rank 0 cannot clean up: the next run on the host removes what it left
        assert _shm_files(procs[0].pid) and remove_stale_files()
    assert not _shm_files(procs[0].pid)


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
