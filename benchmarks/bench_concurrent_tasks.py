"""Eight concurrent conversations of different tasks, interleaved as the server batches them, replayed through every
policy of `tiermoe bench dynamic` (issue 57: "the same goals hold" on a synthetic trace).

Routing from the generator (`tiermoe trace generate`'s model, preset esft-deepseek-v2-lite: 26 MoE layers x 64
experts, top-6, 16 tasks of one seeded workload). Served: tasks 0-7, one per slot, each slot serving
`--conversations` requests of the preset's median length (226 tokens) one after another, every pass one token of
each running conversation (tiermoe.analysis.concurrent_trace.interleave; a request's first token is its prompt).
Two calibrations: `same` (other conversations of the same 8 tasks: the mix served) and `cross` (conversations of
tasks 8-15, none of them served). Costed with DeepSeek-V2-Lite's bf16 experts on the RTX 4090 and H200 profiles,
copies charged in full; the rows are those of bench_cross_task.py, so benchmarks/placement_verdict.py judges them
(calibration `synthetic-8-tasks` = same, `synthetic-other-tasks` = cross). Estimates.

    PYTHONPATH=$PWD python benchmarks/bench_concurrent_tasks.py --out benchmarks/results/concurrent_tasks.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from tiermoe.analysis.concurrent_trace import interleave
from tiermoe.analysis.dynamic_bench import (
    DEFAULT_RATIOS,
    replay_cost_model,
    run_dynamic_bench,
)
from tiermoe.analysis.trace_replay import REPLAY_POLICIES, trace_passes
from tiermoe.arch import detect, load_config
from tiermoe.placement.profiles import load_profile
from tiermoe.routing.generator import generate_requests, generated_trace
from tiermoe.routing.presets import PRESETS
from tiermoe.stats.traces import counts_from_trace
from tiermoe.testing.presets import make_config

SLOTS, TASKS = 8, 16
SERVED, CALIBRATION = "synthetic-8-tasks", {"same": "synthetic-8-tasks", "cross": "synthetic-other-tasks"}


def workload(conversations: int, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the served trace, calibration counts [L, E] by kind). Each task has 2 x `conversations` requests: the first
    half of tasks 0-7 is served, the second half of tasks 0-7 calibrates `same`, the first half of 8-15 `cross`."""
    preset = PRESETS["esft-deepseek-v2-lite"]
    shape = preset.shape
    lengths = [[preset.tokens_per_request] * (2 * conversations) for _ in range(TASKS)]
    requests = list(generate_requests(preset.params, shape, lengths, torch.Generator().manual_seed(seed)))
    by_task = [[r for r in requests if r.task == t] for t in range(TASKS)]
    served = interleave([by_task[t][:conversations] for t in range(SLOTS)], shape)
    calibration = {}
    for kind, chosen in (("same", [r for t in range(SLOTS) for r in by_task[t][conversations:]]),
                         ("cross", [r for t in range(SLOTS, TASKS) for r in by_task[t][:conversations]])):
        trace = generated_trace(shape, chosen)
        calibration[kind] = counts_from_trace(trace, trace["num_layers"], trace["num_experts"]).double()
    return served, calibration


def run(job) -> list[dict]:
    kind, profile, config_dir, ratios, conversations, seed, policies = job
    torch.set_num_threads(1)
    served, calibration = workload(conversations, seed)
    spec = detect(load_config(config_dir))
    bench = run_dynamic_bench(trace_passes(served), replay_cost_model(spec, load_profile(profile)), ratios,
                              calibration[kind], policies=policies)
    return [dict(row, calibration=CALIBRATION[kind], replayed=SERVED, gpu_profile=profile) for row in bench.rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--conversations", type=int, default=4, help="conversations served per slot (default 4)")
    ap.add_argument("--ratios", default=",".join(str(r) for r in DEFAULT_RATIOS))
    ap.add_argument("--profiles", default="rtx4090,h200")
    ap.add_argument("--calibrations", default="same,cross")
    ap.add_argument("--policies", default=",".join(REPLAY_POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    config_dir = tempfile.mkdtemp(prefix="dsv2lite-")
    make_config("deepseek_v2", "deepseek-v2-lite").to_json_file(Path(config_dir) / "config.json")
    ratios = [float(x) for x in args.ratios.split(",")]
    jobs = [(kind, profile, config_dir, ratios, args.conversations, args.seed, tuple(args.policies.split(",")))
            for profile in args.profiles.split(",") for kind in args.calibrations.split(",")]
    start, rows = time.time(), []
    with ProcessPoolExecutor(args.workers) as pool:
        for done in pool.map(run, jobs):
            rows += done
            print(f"{len(rows)} rows, {time.time() - start:.0f} s", flush=True)
    Path(args.out).write_text(json.dumps({"conversations": args.conversations, "slots": SLOTS, "seed": args.seed,
                                          "ratios": ratios, "rows": rows}))


if __name__ == "__main__":
    main()
