#!/usr/bin/env python
"""One GPT-OSS MoE layer on the CPU tier, bf16: the native kernels against the torch path, decode and a batch.

Reads one MoE layer's routed experts of a GPT-OSS checkpoint (a `tiermoe make-model --arch gpt_oss --preset
gpt-oss-20b --layers 1` one has GPT-OSS-20B's shapes: 32 experts, top-4, D = I = 2880, clamped SwiGLU with
biases) into two CPU tiers holding the same bf16 experts: NativeCPUExperts on the kernels (the best ISA, or
$TIERMOE_CPU_ISA) and NativeCPUExperts on its torch path (isa="torch": dequantise each routed expert and multiply
with torch, what GPT-OSS layers computed with before the kernels had their activation). Both run `--threads`
threads (the kernels' team; torch's intra-op threads).

Each round calls both backends `--calls` times on the same routings (top-k of uniform scores per token, bf16
activations ~ N(0, 1)), the backends in alternating order from round to round, so that both see the same
machine; a round's figure is its mean time per call, and the table gives the median over `--rounds` rounds, the
speedup, and the kernels' read rate (bytes of the distinct experts a call routes / its median time). One call
of each backend before the rounds is a warm-up. The kernels' output is checked against the torch path's
(max |y - ref| / max |ref|; bf16 outputs, so about 1e-2 is rounding). Progress goes to stderr, the table to
stdout.

Examples:
  tiermoe make-model --arch gpt_oss --preset gpt-oss-20b --layers 1 --out scratch/gpt-oss-20b-1l
  python benchmarks/bench_cpu_gpt_oss_layer.py --model scratch/gpt-oss-20b-1l
  python benchmarks/bench_cpu_gpt_oss_layer.py --model scratch/gpt-oss-20b-1l --tokens 1,32,256 --rounds 7
  TIERMOE_CPU_ISA=avx2 python benchmarks/bench_cpu_gpt_oss_layer.py --model scratch/gpt-oss-20b-1l --tokens 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from tiermoe.arch import detect, load_config, text_config
from tiermoe.checkpoint.safetensors import Checkpoint
from tiermoe.errors import TiermoeError
from tiermoe.experts.ffn import ExpertActivation
from tiermoe.experts.native import NativeCPUExperts
from tiermoe.experts.tiers import CPUWorker
from tiermoe.model.expert_source import LAYERS_PREFIX, find_expert_source, read_expert

MAX_TOKENS = 4096  # a call's rows: bounds the activations and the torch path's temporaries
MAX_ROUNDS = 100
MAX_CALLS = 100


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GPT-OSS checkpoint directory (bf16 or fp32 experts)")
    p.add_argument("--layer", type=int, help="the MoE layer to read (default: the first)")
    p.add_argument("--tokens", default="1,32", help=f"tokens per call, comma-separated (1..{MAX_TOKENS}; default 1,32)")
    p.add_argument("--rounds", type=int, default=5, help=f"rounds, of which the median is given (1..{MAX_ROUNDS})")
    p.add_argument("--calls", type=int, default=3, help=f"calls per backend and round (1..{MAX_CALLS})")
    p.add_argument("--threads", type=int, default=2, help="kernel team members and torch threads (default 2)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens {args.tokens!r}: expected whole numbers separated by commas, e.g. 1,32")
    cpus = os.cpu_count() or 1
    for name, values, hi in (("--tokens", args.tokens, MAX_TOKENS), ("--rounds", [args.rounds], MAX_ROUNDS),
                             ("--calls", [args.calls], MAX_CALLS), ("--threads", [args.threads], cpus)):
        if any(not 1 <= v <= hi for v in values):
            p.error(f"{name} {','.join(map(str, values))}: expected 1..{hi}")
    return args


def load_layer(args, worker: CPUWorker) -> tuple[NativeCPUExperts, NativeCPUExperts, tuple[int, int, int]]:
    """The layer's experts in a kernel tier and a torch-path tier (bf16 both), and (hidden size, top-k, bytes per
    expert)."""
    cfg = text_config(load_config(args.model))
    spec = detect(cfg)
    if spec.activation != "gpt_oss_glu":
        raise TiermoeError(f"{args.model} is a {spec.model_type} model ({spec.activation} experts); this benchmark "
                           "measures GPT-OSS's clamped SwiGLU: make one with `tiermoe make-model --arch gpt_oss "
                           "--preset gpt-oss-20b --layers 1 --out DIR`")
    layer = spec.moe_layers[0] if args.layer is None else args.layer
    if layer not in spec.moe_layers:
        raise TiermoeError(f"--layer {layer} is not a MoE layer of {args.model}; its MoE layers: "
                           f"{spec.moe_layers[0]}..{spec.moe_layers[-1]}")
    act = ExpertActivation.from_config("gpt_oss_glu", cfg)
    kernels = NativeCPUExperts(worker, act, "bf16", torch.bfloat16, args.threads)
    reference = NativeCPUExperts(worker, act, "bf16", torch.bfloat16, args.threads, isa="torch")
    with Checkpoint(args.model) as ckpt:
        src = find_expert_source(ckpt, spec, LAYERS_PREFIX, layer)
        for e in range(spec.num_experts):
            w = read_expert(ckpt, src, e, spec, torch.bfloat16)
            kernels.add(e, w)
            reference.add(e, w)
    if not kernels.path.startswith("kernels/"):
        raise TiermoeError(f"the kernels do not compute this layer here (path: {kernels.path}); see `tiermoe version`")
    log(f"layer {layer}: {spec.num_experts} experts, top-{spec.top_k}, D={spec.hidden_size}, "
        f"I={spec.expert_intermediate_size}, {kernels.nbytes / 1e9:.2f} GB; kernels: {kernels.path}")
    return kernels, reference, (spec.hidden_size, spec.top_k, kernels.nbytes // spec.num_experts)


def routings(args, t: int, d: int, e: int, k: int, n: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(args.seed + t)
    return [(torch.randn(t, d, generator=g).to(torch.bfloat16), torch.rand(t, e, generator=g).topk(k, dim=1).indices,
             torch.softmax(torch.randn(t, k, generator=g), dim=1)) for _ in range(n)]


def call(tier: NativeCPUExperts, x, ids, w) -> torch.Tensor:
    tier.submit(x, ids, w)
    return tier.sync()


def measure(args, kernels, reference, t: int, shape: tuple[int, int, int]) -> dict:
    d, k, expert_bytes = shape
    calls = routings(args, t, d, len(kernels), k, args.calls)
    y, ref = call(kernels, *calls[0]), call(reference, *calls[0])  # warm-up, and the check
    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    times = {"kernels": [], "torch": []}
    for r in range(args.rounds):
        order = ("kernels", "torch") if r % 2 == 0 else ("torch", "kernels")
        for name in order:
            tier = kernels if name == "kernels" else reference
            t0 = time.perf_counter()
            for x, ids, w in calls:
                call(tier, x, ids, w)
            times[name].append((time.perf_counter() - t0) / len(calls))
    med = {name: statistics.median(v) for name, v in times.items()}
    routed = statistics.mean(len(torch.unique(ids)) for _, ids, _ in calls)
    log(f"{t} token(s): kernels {med['kernels'] * 1e3:.1f} ms, torch {med['torch'] * 1e3:.1f} ms")
    return {"tokens": t, "kernels": med["kernels"], "torch": med["torch"], "routed": routed,
            "rate": routed * expert_bytes / med["kernels"], "err": err}


def table(rows: list[dict], args, path: str) -> str:
    lines = [f"One GPT-OSS MoE layer, bf16 experts, {args.threads} thread(s), kernels {path}; median of "
             f"{args.rounds} alternating rounds of {args.calls} calls", "",
             "| tokens | experts routed | kernels (ms) | torch path (ms) | speedup | kernels' read rate (GB/s) | "
             "max rel. diff |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['routed']:.1f} | {r['kernels'] * 1e3:.1f} | {r['torch'] * 1e3:.1f} | "
                     f"{r['torch'] / r['kernels']:.1f}x | {r['rate'] / 1e9:.1f} | {r['err']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    worker = CPUWorker()
    try:
        kernels, reference, shape = load_layer(args, worker)
        rows = [measure(args, kernels, reference, t, shape) for t in args.tokens]
    except TiermoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        worker.close()
    print(table(rows, args, kernels.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
