#!/usr/bin/env python
"""One expert's four training products on the CPU tier: the packed kernels against torch.

For a Qwen3-30B-A3B expert (D=2048, I=768) stored bf16 or int4 on a NativeCPUExperts tier, and M rows routed to
it, times each product of tiermoe.experts.expert_matmuls (gate_up = x W_gu^T, down = a W_d^T, gate_up_t = g W_gu,
down_t = g W_d) three ways:
  kernel       NativeCPUExperts.matmuls: the packed kernels on the tier's thread team, called from the main thread
  torch deq    torch on the dequantised expert (`tier.get(e)`), the fallback's matmul, without its dequantisation
  torch bf16   torch on the checkpoint's bf16 weights (a torch CPU tier that keeps bf16 copies)
and the time to dequantise one expert (`tier.get(e)`: what the fallback pays per expert before its matmuls).
Each call cycles through --experts experts (separate weights, so the caches hold no more than in training), on
--threads threads for both the kernels and torch; the three ways are timed call by call in turn, so on a shared
machine they see the same conditions. Best and median of --reps calls, in ms; GFLOP/s of the kernel's best.

Examples:
  python benchmarks/bench_expert_matmuls.py
  python benchmarks/bench_expert_matmuls.py --formats int4 --rows 32 --dtypes fp32 --reps 20
  python benchmarks/bench_expert_matmuls.py --cpu-time      # 1 thread, CPU time: for a busy shared machine
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

import torch

from tiermoe.experts.expert_matmuls import TorchMatmuls
from tiermoe.experts.ffn import ExpertActivation
from tiermoe.experts.native import NativeCPUExperts
from tiermoe.experts.tiers import CPUWorker
from tiermoe.experts.weights import ExpertWeights

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PRODUCTS = ("gate_up", "down", "gate_up_t", "down_t")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Example: python benchmarks/bench_expert_matmuls.py --formats int4 --rows 8",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="bf16,int4", help="stored formats (bf16,int8,int4; default bf16,int4)")
    p.add_argument("--rows", default="8,32,128", help="rows routed to the expert (default 8,32,128)")
    p.add_argument("--dtypes", default="bf16,fp32", help="activation dtypes (bf16,fp32; default both)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=8, help="experts cycled through (default 8)")
    p.add_argument("--threads", type=int, default=2, help="kernel team and torch threads (default 2)")
    p.add_argument("--reps", type=int, default=30, help="timed calls per cell (default 30)")
    p.add_argument("--cpu-time", action="store_true",
                   help="1 thread, each call timed by the calling thread's CPU time (all the work runs on it), which "
                        "leaves out the time other processes held the core: steadier figures on a shared machine")
    return p.parse_args(argv)


def timed(fn, args_list: list, reps: int, clock=time.perf_counter) -> tuple[float, float]:
    """(best, median) ms of fn(*args) over `reps` calls cycling through args_list, after one warm-up pass."""
    return round_robin([(fn, args_list)], reps, clock)[0]


def round_robin(cases: list, reps: int, clock=time.perf_counter) -> list[tuple[float, float]]:
    """(best, median) ms of each (fn, args_list) case, timed call by call in turn, so that on a shared, noisy
    machine every case sees the same conditions; each cycles through its args_list after one warm-up pass."""
    for fn, args_list in cases:
        for a in args_list:
            fn(*a)
    times = [[] for _ in cases]
    for r in range(reps):
        for (fn, args_list), out in zip(cases, times):
            a = args_list[r % len(args_list)]
            t0 = clock()
            fn(*a)
            out.append((clock() - t0) * 1e3)
    return [(min(t), statistics.median(t)) for t in times]


def input_width(product: str, d: int, i: int) -> tuple[int, int]:
    """(width in, width out) of a product."""
    return {"gate_up": (d, 2 * i), "down": (i, d), "gate_up_t": (2 * i, d), "down_t": (d, i)}[product]


def main(argv=None) -> None:
    args = parse_args(argv)
    d, i, n_exp = args.hidden, args.intermediate, args.experts
    threads, clock = (1, time.thread_time) if args.cpu_time else (args.threads, time.perf_counter)
    torch.set_num_threads(threads)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"uptime before timing: {uptime}")
    print(f"machine: {os.cpu_count()} logical CPUs; {threads} threads; torch {torch.__version__}; "
          f"{'CPU time of the calling thread' if args.cpu_time else 'wall time'}")
    g = torch.Generator().manual_seed(0)
    bf16 = [ExpertWeights((torch.randn(2 * i, d, generator=g) * 0.02).bfloat16(),
                          (torch.randn(d, i, generator=g) * 0.02).bfloat16()) for _ in range(n_exp)]
    worker = CPUWorker()
    rows_out, deq_rows = [], []
    try:
        for fmt in args.formats.split(","):
            for dname in args.dtypes.split(","):
                dtype = DTYPES[dname]
                tier = NativeCPUExperts(worker, ExpertActivation("silu_glu"), fmt, dtype, threads=threads)
                for e, w in enumerate(bf16):
                    tier.add(e, w)
                best, med = timed(tier.get, [(e,) for e in range(n_exp)], max(4, args.reps // 5), clock)
                deq_rows.append((fmt, dname, best, med))
                kernel = [tier.matmuls(e, dtype) for e in range(n_exp)]
                deq = [TorchMatmuls(tier.get(e), dtype) for e in range(n_exp)]
                plain = [TorchMatmuls(w, dtype) for w in bf16]
                for m in map(int, args.rows.split(",")):
                    for product in PRODUCTS:
                        w_in, w_out = input_width(product, d, i)
                        x = torch.randn(m, w_in, generator=g).to(dtype)
                        call = (lambda ops, x, product=product: getattr(ops, product)(x))
                        cells = round_robin([(call, [(o, x) for o in objs]) for objs in (kernel, deq, plain)],
                                            args.reps, clock)
                        gflops = 2 * m * w_in * w_out / (cells[0][0] * 1e-3) / 1e9
                        rows_out.append((fmt, dname, m, product, *cells, gflops))
                        print(f"[{time.strftime('%H:%M:%S')}] {fmt} {dname} M={m} {product}: "
                              + " / ".join(f"{b:.3f}" for b, _ in cells), file=sys.stderr, flush=True)
                del tier, kernel, deq, plain
    finally:
        worker.close()
    print(f"uptime after timing: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print()
    print("| format | activations | M | product | kernel best (median) ms | torch deq. ms | torch bf16 ms | "
          "kernel GFLOP/s | torch deq. / kernel |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt, dname, m, product, k, t, p, gflops in rows_out:
        print(f"| {fmt} | {dname} | {m} | {product} | {k[0]:.3f} ({k[1]:.3f}) | {t[0]:.3f} ({t[1]:.3f}) | "
              f"{p[0]:.3f} ({p[1]:.3f}) | {gflops:.0f} | {t[0] / k[0]:.2f}x |")
    print()
    print("| format | model dtype | dequantise one expert (`tier.get`), best (median) ms |")
    print("|---|---|---|")
    for fmt, dname, best, med in deq_rows:
        print(f"| {fmt} | {dname} | {best:.2f} ({med:.2f}) |")


if __name__ == "__main__":
    main()
