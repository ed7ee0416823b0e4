"""KTransformers' seven-step multi-GPU workflow, on the bundled model with 2 ranks (torchrun, gloo, GPU tier = CPU).

    python examples/multi_gpu_workflow.py [--num-gpu-experts 12] [--max-tokens 16] [--gpu-device cpu] [--workdir DIR]

This process does steps 1-3 and the 1-rank reference, then launches 2 ranks with torchrun (step 6), which do
steps 4, 5 and 7; at the end it checks that the 2 ranks generated exactly what 1 process did.
1. collect statistics: route a few chat prompts through the model, count (token, expert) pairs -> activation_freq.pt
2. generate masks: generate_gpu_experts_masks(activation_freq, num_gpu_experts): the hottest experts, over all layers
3. partition per rank: split the GPU experts between the 2 ranks (balanced by load) -> plan.json
4. place parameters: each rank loads the non-expert weights and its own GPU experts onto its device
5. CPU buffers: rank 0 reads the CPU experts into a KExpertsCPUBuffer in shared memory; rank 1 maps the same pages
6. launch ranks with torchrun (`python -m torch.distributed.run --standalone --nproc-per-node 2`)
7. serve: rank 0 generates (greedy) while rank 1 follows its steps; every MoE layer sums the ranks' outputs
On GPUs, pass --gpu-device cuda: rank r then uses cuda:r.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import tiermoe
from tiermoe.arch import detect, load_config
from tiermoe.bundled import resolve_model
from tiermoe.compat import (
    KExpertsCPUBuffer,
    build_device_map,
    generate_gpu_experts_masks,
)
from tiermoe.placement.partition import split_across_gpus
from tiermoe.placement.plan import PlacementPlan
from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.recorders import make_recorder

NUM_RANKS = 2
DTYPE = torch.float32  # exact: the ranks' partial sums then match one process's to the token
CALIBRATION = ["Hello! How are you today?", "Can you give me a recipe for pancakes?",
               "What should I see in Paris?", "Tell me a joke about computers."]
PROMPTS = ["Hi! What do you like to do on weekends?", "Write a short poem about the sea."]


def chat_ids(llm, prompts: list[str]) -> list[list[int]]:
    return [llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in prompts]


def show(mask: torch.Tensor) -> str:
    rows = (" ".join("G" if on else "." for on in row) for row in mask.tolist())
    return "\n".join(f"    layer {i}: {row}" for i, row in enumerate(rows))


# --- this process: steps 1-3, the 1-rank reference, step 6 --------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-gpu-experts", type=int, default=12, help="GPU experts over all layers (default 12)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--gpu-device", default="cpu", help="cpu (default) or cuda (rank r on cuda:r)")
    parser.add_argument("--workdir", type=Path, help="keep activation_freq.pt and plan.json here (default: a "
                        "temporary directory, removed at the end)")
    parser.add_argument("--rank-program", metavar="DIR", help=argparse.SUPPRESS)  # what torchrun starts
    args = parser.parse_args()
    if args.rank_program:
        return rank_main(Path(args.rank_program))

    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return workflow(args, args.workdir)
    with tempfile.TemporaryDirectory(prefix="tiermoe-workflow-") as work:
        return workflow(args, Path(work))


def workflow(args: argparse.Namespace, work: Path) -> None:
    model_dir = resolve_model(None)
    spec = detect(load_config(model_dir))
    print(f"model: {model_dir.name} ({spec.model_type}, {spec.num_moe_layers} MoE layers x {spec.num_experts} "
          f"experts, top-{spec.top_k}); files in {work}\n")

    print("1. collect statistics")
    recorder = make_recorder("stat", ModelShape.of(spec), buffer_size=-1)
    with tiermoe.LLM(model_dir, dtype=DTYPE, recorder=recorder, progress=False) as llm:
        llm.generate(chat_ids(llm, CALIBRATION), tiermoe.SamplingParams(max_tokens=args.max_tokens))
    counts = recorder.dump()["logical_count"].sum(dim=0).double()  # [L, E] routed (token, expert) pairs
    activation_freq = counts / counts.sum(dim=1, keepdim=True)
    torch.save(activation_freq, work / "activation_freq.pt")
    print(f"   {int(counts.sum())} routed pairs -> activation_freq.pt {list(activation_freq.shape)}\n")

    print("2. generate masks")
    activation_freq = torch.load(work / "activation_freq.pt", weights_only=True)
    mask = generate_gpu_experts_masks(activation_freq, num_gpu_experts=args.num_gpu_experts)
    print(f"   the {args.num_gpu_experts} most used experts go to the GPU tier (G), the rest stay on the CPU (.):")
    print(show(mask) + "\n")

    print("3. partition per rank")
    plan = PlacementPlan(split_across_gpus(mask, NUM_RANKS, "balanced", counts), num_gpus=NUM_RANKS)
    plan.save(work / "plan.json")
    for rank in range(NUM_RANKS):
        share = (counts * plan.rank_mask(rank)).sum() / counts.sum()
        print(f"   rank {rank}: {int(plan.rank_mask(rank).sum())} experts, {100 * share:.1f}% of the routed pairs")
    on_cpu = sum(device == "cpu" for device in build_device_map(plan).values())
    print(f"   CPU tier: {on_cpu} experts (computed once, by rank 0) -> plan.json\n")

    with tiermoe.LLM(model_dir, placement=mask, dtype=DTYPE, progress=False) as llm:  # the 1-rank reference
        reference = [o.token_ids for o in llm.generate(chat_ids(llm, PROMPTS),
                                                       tiermoe.SamplingParams(max_tokens=args.max_tokens))]
    (work / "job.json").write_text(json.dumps({"max_tokens": args.max_tokens, "gpu_device": args.gpu_device}))

    print(f"6. launch ranks with torchrun ({NUM_RANKS} processes); they run steps 4, 5 and 7")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NUM_RANKS}",
                __file__, "--rank-program", str(work)]
    # torchrun sets OMP_NUM_THREADS=1 (with a banner) where it is unset; say so ourselves, the model is tiny
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = subprocess.run(torchrun, env=env, check=False).returncode
    if code != 0:
        sys.exit(f"error: the ranks failed (torchrun exit status {code}); their output above says why")

    served = json.loads((work / "served.json").read_text())
    print(f"\n1 rank : {reference}\n{NUM_RANKS} ranks: {served['tokens']}")
    print(f"{NUM_RANKS}-rank output equals 1-rank output: {served['tokens'] == reference}")


# --- each rank: steps 4, 5, 7 -------------------------------------------------------------------------------
def rank_main(work: Path) -> None:
    from tiermoe.distributed import RankEnv, RankGroup, RankModel, rank_device

    job = json.loads((work / "job.json").read_text())
    env = RankEnv.from_env()
    plan = PlacementPlan.load(work / "plan.json")
    with RankGroup(env, rank_device(job["gpu_device"], env), timeout_s=120) as group, \
            RankModel(group, None, plan, dtype=DTYPE, progress=False) as rm:
        tiers = rm.hybrid.tier_bytes()
        placed = group.all_gather((str(group.device), tiers.non_expert, tiers.gpu_experts, tiers.cpu_experts))
        buffer = KExpertsCPUBuffer.of(rm)  # step 5: the engine's own store, seen through the compat API
        layer, expert = next((layer, e) for layer in rm.hybrid.spec.moe_layers
                             for e in range(plan.num_experts) if plan.assignment[layer, e] < 0)
        slot = buffer.get(layer, expert)
        seen = group.all_gather((slot.gate_up.double().sum().item(), slot.down.double().sum().item(), buffer.name))
        if group.rank == 0:
            print("4. place parameters (rank: device, non-expert weights, its GPU experts, CPU experts it computes)")
            print("   (KTransformers moves them with move_non_experts_to_gpu(model, f'cuda:{rank}'); tiermoe's loader "
                  "reads each tensor straight onto its device)")
            for rank, (device, non_expert, gpu, cpu) in enumerate(placed):
                print(f"   rank {rank}: {device}, {non_expert / 2**20:.1f} MiB, {gpu / 2**20:.1f} MiB, "
                      f"{cpu / 2**20:.1f} MiB")
            print(f"5. CPU buffers: KExpertsCPUBuffer '{buffer.name}' in shared memory, "
                  f"{buffer.nbytes / 2**20:.1f} MiB held once for the host (pinned: {buffer.pinned})")
            same = all(s == seen[0] for s in seen)
            print(f"   layer {layer} expert {expert}: every rank maps the same bytes: {same}")
            print("7. serve: rank 0 generates, rank 1 follows")
            outs = rm.llm.generate(chat_ids(rm.llm, PROMPTS), tiermoe.SamplingParams(max_tokens=job["max_tokens"]))
            for prompt, out in zip(PROMPTS, outs):
                print(f"   user: {prompt}\n   model: {out.text!r}")
            (work / "served.json").write_text(json.dumps({"tokens": [o.token_ids for o in outs],
                                                          "same_bytes": same}))
        else:
            rm.follow()


if __name__ == "__main__":
    main()
