"""Host memory of 2 ranks against one process: one shared copy of the CPU experts, not one per rank.

Both runs load the same checkpoint with the same GPU experts (gpu_device="cpu", so "GPU" experts are host memory
too), run one forward, and measure proportional set size (PSS, from /proc/PID/smaps_rollup) while loaded: PSS
splits every shared page between the processes that map it, so the ranks' PSS adds up to what they hold together
(RSS would count the shared CPU experts once per mapping process). The goal: total PSS of the 2 ranks <= one
process's PSS + 1 GiB (a second interpreter with torch, and a second copy of the non-expert weights).

    python benchmarks/bench_multi_rank_memory.py --dir scratch/tiermoe-bench/q30b-5l-v1k
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# Made checkpoints go to the system's temporary folder unless --dir says otherwise: they are scratch, remade
# when missing, and a few GB each.
SCRATCH = Path(tempfile.gettempdir()) / "tiermoe-bench"

GIB = 1024**3
PROMPT = [[5, 6, 7, 8, 9, 10, 11, 12]]


def make_checkpoint(model_dir: Path, layers: int) -> None:
    from tiermoe.testing.make_model import make_model

    # Qwen3-30B-A3B's experts (128 per layer, 9 MiB each in bf16) with a small vocabulary, so the non-expert
    # weights every rank replicates stay small next to the experts.
    make_model("qwen3_moe", model_dir, preset="qwen3-30b-a3b", layers=layers,
               config_overrides={"vocab_size": 1024, "max_position_embeddings": 4096})


def plan_config(gpu_experts: int, num_gpus: int):
    from tiermoe.config import PlacementConfig

    return PlacementConfig(num_gpu_experts=gpu_experts, num_gpus=num_gpus, gpu_split="balanced")


def cpu_config(backend: str):
    from tiermoe.config import CPUConfig

    return CPUConfig(backend=backend)


def one_process(model_dir: str, gpu_experts: int, backend: str) -> dict:
    """Run in a fresh process: load with the same GPU experts on one 'GPU', one forward, measure."""
    import torch

    from tiermoe.distributed import memory_rollup
    from tiermoe.model.loader import load_hybrid_model
    from tiermoe.model.plan_source import placement_target
    from tiermoe.placement.planner import make_plan

    mask = make_plan(plan_config(gpu_experts, 1), placement_target(model_dir)).mask
    with load_hybrid_model(model_dir, mask, gpu_device="cpu", progress=False, cpu=cpu_config(backend)) as hybrid:
        hybrid(input_ids=torch.tensor(PROMPT))
        tb = hybrid.tier_bytes()
        return {"rollup": memory_rollup(), "cpu_experts": tb.cpu_experts, "gpu_experts": tb.gpu_experts,
                "non_expert": tb.non_expert}


def rank_process(model_dir: str, gpu_experts: int, backend: str) -> dict | None:
    """Run as one of the ranks: load this rank's share, one forward, then all ranks measure at once."""
    import torch

    from tiermoe.distributed import RankEnv, RankGroup, RankModel, memory_rollup

    env = RankEnv.from_env()
    with RankGroup(env, torch.device("cpu"), timeout_s=600) as group, \
            RankModel(group, model_dir, plan_config(gpu_experts, env.world_size), progress=False,
                      cpu=cpu_config(backend)) as ranked:
        ranked.hybrid(input_ids=torch.tensor(PROMPT))  # every rank calls the model: one forward
        group.barrier("before measuring")
        tb = ranked.hybrid.tier_bytes()
        mine = {"rank": env.rank, "rollup": memory_rollup(), "cpu_experts": tb.cpu_experts,
                "gpu_experts": tb.gpu_experts, "non_expert": tb.non_expert,
                "shm": ranked.share.store.allocated_bytes() if env.rank == 0 else 0}
        everyone = group.all_gather(mine, "gathering measurements")
        if env.rank != 0:
            ranked.follow()  # until rank 0 closes
    return everyone if env.rank == 0 else None


def run(model_dir: Path, gpu_experts: int, ranks: int, backend: str) -> dict:
    from tiermoe.distributed import spawn_ranks

    me = str(Path(__file__).resolve())
    flags = ["--dir", str(model_dir), "--gpu-experts", str(gpu_experts), "--cpu-backend", backend]
    single = subprocess.run([sys.executable, me, "--worker", "single", *flags], check=True, stdout=subprocess.PIPE,
                            text=True)
    procs = spawn_ranks([sys.executable, me, "--worker", "rank", *flags], ranks, stdout=subprocess.PIPE, text=True)
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    return {"single": json.loads(single.stdout.strip().splitlines()[-1]),
            "ranks": json.loads(outputs[0].strip().splitlines()[-1])}


def table(result: dict) -> str:
    single, ranks = result["single"], result["ranks"]

    def row(name, r):
        roll = r["rollup"]
        return (f"| {name} | {roll['Pss'] / GIB:.2f} | {roll.get('Pss_Shmem', 0) / GIB:.2f} | "
                f"{roll.get('Pss_Anon', 0) / GIB:.2f} | {roll['Rss'] / GIB:.2f} |")

    total = sum(r["rollup"]["Pss"] for r in ranks)
    limit = single["rollup"]["Pss"] + GIB
    lines = ["| process | PSS GiB | of it shared memory | of it anonymous | RSS GiB |", "|---|---|---|---|---|",
             row("one process", single)]
    lines += [row(f"rank {r['rank']}", r) for r in ranks]
    lines += [f"| **ranks, total** | **{total / GIB:.2f}** | | | {sum(r['rollup']['Rss'] for r in ranks) / GIB:.2f} |",
              f"| limit: one process + 1 GiB | {limit / GIB:.2f} | | | |", ""]
    shares = ", ".join(f"rank {r['rank']} {r['gpu_experts'] / GIB:.2f}" for r in ranks)
    lines.append(f"CPU-tier experts {single['cpu_experts'] / GIB:.2f} GiB (held once, by rank 0; /dev/shm: "
                 f"{ranks[0]['shm'] / GIB:.2f} GiB allocated); GPU-tier experts {single['gpu_experts'] / GIB:.2f} GiB "
                 f"({shares}); non-expert weights {single['non_expert'] / GIB:.2f} GiB per process.")
    lines.append(f"total PSS of the ranks - one process = {(total - single['rollup']['Pss']) / GIB:.2f} GiB "
                 f"({'within' if total <= limit else 'OVER'} the 1 GiB allowance)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=str(SCRATCH / "q30b-5l-v1k"), help="checkpoint (made if missing)")
    parser.add_argument("--layers", type=int, default=5, help="layers of the checkpoint made (default 5: 5.6 GiB "
                        "of experts)")
    parser.add_argument("--gpu-experts", type=int, default=16, help="GPU experts per layer, over both ranks")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cpu-backend", default="native", choices=("native", "torch"),
                        help="native (default): packs each expert into its own copy, held by rank 0; torch: "
                             "computes from the experts' shared-memory slots")
    parser.add_argument("--json", help="also write the measurements here")
    parser.add_argument("--worker", choices=("single", "rank"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "single":
        print(json.dumps(one_process(args.dir, args.gpu_experts, args.cpu_backend)))
        return
    if args.worker == "rank":
        result = rank_process(args.dir, args.gpu_experts, args.cpu_backend)
        if result is not None:
            print(json.dumps(result))
        return
    model_dir = Path(args.dir)
    if not (model_dir / "config.json").exists():
        make_checkpoint(model_dir, args.layers)
    result = run(model_dir, args.gpu_experts, args.ranks, args.cpu_backend)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
