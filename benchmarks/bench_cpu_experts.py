#!/usr/bin/env python
"""One MoE layer's CPU experts, every backend and format, against this machine's own limits, in one run.

1. Machine: read bandwidth (best of torch.mv and sum over a 1 GiB fp32 matrix) and bf16 GEMM rate (2048^3), at
   each thread count.
2. One MoE layer (default: Qwen3-30B-A3B shapes, E=128, top-8, D=2048, I=768, bf16 weights ~ N(0, 0.02)) at 1, 8
   and 512 tokens, for tiermoe's backends (native bf16/int8/int4, torch) and the peers when installed:
   kt-kernel (AMX BF16 / INT8 / INT4, at 1 and 2 of its threads) and transformers' own Qwen3MoeExperts
   (grouped_mm). Each backend cycles through copies of the layer totalling >= 1 GiB, so caches do not help, and
   every backend sees the same random routing (top-k of uniform scores per token). The backends are timed call
   by call in turn (round robin), so on a shared, noisy machine they all see the same conditions; kt-kernel is
   built once per thread count (a pass) while the others stay resident and are timed in every pass. The machine's
   limits are probed again after every round and the best probe is kept.
3. Accuracy: each backend's output for 64 tokens against fp32 (max |y - ref| / max |ref|).

The floor of a call is max(bytes of the distinct experts it routes / read bandwidth, FLOPs / GEMM rate). The table
gives best and median time, the ratio of the best to the floor, and the ratio of each peer's best time to this
row's best (x > 1: this row is faster). Progress goes to stderr, the table to stdout.

Examples:
  python benchmarks/bench_cpu_experts.py                               # everything (about 10 minutes)
  python benchmarks/bench_cpu_experts.py --tokens 1 --formats bf16 --backends native,hf --reps 10
  TIERMOE_CPU_ISA=avx512bf16 python benchmarks/bench_cpu_experts.py --backends native   # without AMX
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import time

import torch

from tiermoe.experts.ffn import ExpertActivation, routed_experts_forward
from tiermoe.experts.tiers import CPUWorker, TorchCPUExperts
from tiermoe.experts.weights import ExpertWeights

GiB = 1 << 30
ACT = ExpertActivation("silu_glu")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Example: python benchmarks/bench_cpu_experts.py --tokens 1,512 --reps 20",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8,512", help="token counts per call (default 1,8,512)")
    p.add_argument("--threads", default="2", help="thread counts for tiermoe and transformers (default 2)")
    p.add_argument("--kt-threads", default="1,2", help="kt-kernel worker threads to try (default 1,2)")
    p.add_argument("--backends", default="native,torch,hf,kt", help="any of native,torch,hf,kt")
    p.add_argument("--formats", default="bf16,int8,int4", help="expert formats for native and kt")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--reps", type=int, default=40, help="timed calls for 1 and 8 tokens (a fifth of it for 512)")
    p.add_argument("--cycle-gib", type=float, default=1.0, help="GiB of weight copies each backend cycles through")
    p.add_argument("--no-accuracy", action="store_true", help="skip the accuracy section")
    p.add_argument("--out", help="also write the table (markdown) to this file; kt-kernel prints to stdout too")
    return p.parse_args(argv)


# -- the machine ------------------------------------------------------------------------------------------------

class MachineProbe:
    """Read bandwidth (torch.mv over a 1 GiB fp32 matrix) and bf16 GEMM rate (2048^3) at each thread count.

    Probed again between rounds of the backends, and the best of every probe is kept: on a shared machine the
    limits move with the other load, and the floor should be the machine's best, not one unlucky sample."""

    def __init__(self, threads: list[int]):
        self.threads = threads
        self.big, self.vec = torch.ones(16384, 16384), torch.ones(16384)
        self.m = torch.randn(2048, 2048, dtype=torch.bfloat16)
        self.limits = {n: (0.0, 0.0) for n in threads}
        self.count = 0

    def probe(self, n: int) -> None:
        torch.set_num_threads(n)
        t0 = time.perf_counter()
        torch.mv(self.big, self.vec)
        t1 = time.perf_counter()
        self.m @ self.m
        t2 = time.perf_counter()
        bw, fl = self.limits[n]
        self.limits[n] = (max(bw, self.big.numel() * 4 / (t1 - t0)), max(fl, 2 * 2048**3 / (t2 - t1)))
        self.count += 1

    def round(self) -> None:
        """One probe, cycling through the thread counts."""
        self.probe(self.threads[self.count % len(self.threads)])


# -- backends ---------------------------------------------------------------------------------------------------

class Layer:
    """Copies of one MoE layer in one backend at `threads`; call(i, x, ids, w) runs copy i (the public
    submit / sync path). Layers of one backend at several thread counts share their copies."""

    def __init__(self, name: str, fmt: str, copies: list, bytes_per_expert: float, close=None, threads: int = 1):
        self.name, self.fmt, self.copies, self.bytes_per_expert, self._close = name, fmt, copies, bytes_per_expert, close
        self.threads = threads

    def at(self, threads: int) -> Layer:
        return Layer(self.name, self.fmt, self.copies, self.bytes_per_expert, None, threads)

    def call(self, i: int, x, ids, w):
        torch.set_num_threads(self.threads)
        tier = self.copies[i % len(self.copies)]
        if callable(tier):
            return tier(x, ids, w)
        if hasattr(tier, "threads") and not self.name.startswith("kt"):
            tier.threads = self.threads  # native: the worker keeps one team per thread count
        tier.submit(x, ids, w)
        return tier.sync()

    def close(self):
        self.copies.clear()
        if self._close:
            self._close()
        gc.collect()


def copies_needed(layer_bytes: float, gib: float) -> int:
    return max(1, int(-(-gib * GiB // layer_bytes)))


def build_native(fmt, src, args, threads) -> Layer:
    from tiermoe.experts.native import NativeCPUExperts

    worker = CPUWorker()
    gu, dn = src
    copies = []
    while not copies or len(copies) < copies_needed(copies[0].nbytes, args.cycle_gib):
        tier = NativeCPUExperts(worker, ACT, fmt, torch.bfloat16, threads)
        for e in range(args.experts):
            tier.add(e, ExpertWeights(gu[e], dn[e]))
        copies.append(tier)
    per_expert = copies[0].nbytes / args.experts
    log(f"  native {fmt}: {len(copies)} copies of {copies[0].nbytes / 1e9:.2f} GB, path {copies[0].path}")
    return Layer(f"native {copies[0].path.split('/')[-1]}", fmt, copies, per_expert, worker.close)


def build_torch(src, args, threads) -> Layer:
    worker = CPUWorker()
    gu, dn = src
    tier = TorchCPUExperts(worker, ACT)
    for e in range(args.experts):
        tier.add(e, ExpertWeights(gu[e], dn[e]))
    torch.set_num_threads(threads)
    return Layer("torch reference", "bf16", [tier], 3 * args.hidden * args.intermediate * 2, worker.close)


def build_hf(src, args, threads) -> Layer:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                         num_experts=args.experts, num_experts_per_tok=args.top_k)
    cfg._experts_implementation = "grouped_mm"  # what transformers picks for these models on torch 2.13 CPU
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(src[0], requires_grad=False)
    mod.down_proj = torch.nn.Parameter(src[1], requires_grad=False)
    torch.set_num_threads(threads)

    def call(x, ids, w):
        with torch.inference_mode():
            return mod(x, ids, w.to(x.dtype))

    return Layer("transformers grouped_mm", "bf16", [call], 3 * args.hidden * args.intermediate * 2)


def build_kt(fmt, src, args, threads) -> Layer:
    from tiermoe.experts.kt import KtCPUExperts

    worker = CPUWorker()
    gu, dn = src
    bpp = {"bf16": 2, "int8": 1, "int4": 0.5}[fmt]
    n = copies_needed(args.experts * 3 * args.hidden * args.intermediate * bpp, args.cycle_gib)
    copies = []
    for c in range(n):
        tier = KtCPUExperts(worker, ACT, fmt, torch.bfloat16, threads, layer=c)
        for e in range(args.experts):
            tier.add(e, ExpertWeights(gu[e], dn[e]))
        tier.submit(*routings(args, 1, 1, seed=99)[0])  # kt loads (and quantises) at the first forward
        tier.sync()
        copies.append(tier)
    log(f"  kt {fmt}, {threads} thread(s): {n} copies")
    return Layer(f"kt-kernel {threads}T", fmt, copies, 3 * args.hidden * args.intermediate * bpp, worker.close)


# -- timing -----------------------------------------------------------------------------------------------------

def routings(args, tokens: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = (torch.randn(tokens, args.hidden, generator=g)).to(torch.bfloat16)
        ids = torch.rand(tokens, args.experts, generator=g).topk(args.top_k, dim=1).indices
        w = torch.softmax(torch.randn(tokens, args.top_k, generator=g), dim=1)
        out.append((x, ids, w))
    return out


def accuracy(layer: Layer, src, args) -> float:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, args.hidden, generator=g)
    ids = torch.rand(64, args.experts, generator=g).topk(args.top_k, dim=1).indices
    w = torch.softmax(torch.randn(64, args.top_k, generator=g), dim=1)
    hit = torch.unique(ids).tolist()
    ref = routed_experts_forward({e: ExpertWeights(src[0][e].float(), src[1][e].float()) for e in hit}, x, ids, w, ACT)
    y = layer.call(0, x.to(torch.bfloat16), ids, w).float()
    return ((y - ref).abs().max() / ref.abs().max()).item()


# -- main -------------------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    args = parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    kt_threads = [int(t) for t in args.kt_threads.split(",")]
    backends = args.backends.split(",")
    formats = args.formats.split(",")
    if "kt" in backends:
        try:
            import kt_kernel  # noqa: F401
        except ImportError:
            log("kt-kernel is not installed: skipping it")
            backends.remove("kt")

    machine = MachineProbe(sorted(set(threads) | ({*kt_threads} if "kt" in backends else set())))
    for _ in range(3):
        for n in machine.threads:
            machine.probe(n)
    for n, (bw, fl) in machine.limits.items():
        log(f"machine, {n} thread(s): read {bw / 1e9:.1f} GB/s, bf16 GEMM {fl / 1e9:.0f} GFLOP/s (first probes)")

    log(f"random bf16 weights: {args.experts} experts x (2x{args.intermediate}x{args.hidden} + "
        f"{args.hidden}x{args.intermediate})")
    torch.manual_seed(0)
    src = (torch.randn(args.experts, 2 * args.intermediate, args.hidden, dtype=torch.bfloat16) * 0.02,
           torch.randn(args.experts, args.hidden, args.intermediate, dtype=torch.bfloat16) * 0.02)
    calls = {t: routings(args, t, args.reps if t < 512 else max(3, args.reps // 5), seed=t) for t in tokens}

    # tiermoe's backends and transformers stay resident; kt-kernel is built once per thread count (a pass). In
    # each pass every resident layer is timed call by call in turn with the others, so all of them see the same
    # machine: on a shared machine that is what keeps the ratios honest.
    resident = []
    if "native" in backends:
        for fmt in formats:
            log(f"building native {fmt}")
            base = build_native(fmt, src, args, threads[0])
            resident += [base.at(n) for n in threads]
    if "torch" in backends:
        base = build_torch(src, args, threads[0])
        resident += [base.at(n) for n in threads]
    if "hf" in backends:
        base = build_hf(src, args, threads[0])
        resident += [base.at(n) for n in threads]
    samples: dict[tuple, list[float]] = {}
    errors = {}
    passes = kt_threads if "kt" in backends else [None]
    for p, kt_n in enumerate(passes, 1):
        kt_layers = []
        if kt_n is not None:
            for fmt in formats:
                log(f"pass {p}/{len(passes)}: building kt-kernel {fmt}, {kt_n} thread(s)")
                kt_layers.append(build_kt(fmt, src, args, kt_n).at(kt_n))
        layers = resident + kt_layers
        for t in tokens:
            log(f"pass {p}/{len(passes)}: {t} token(s), {len(calls[t])} calls x {len(layers)} layers")
            for layer in layers:
                for i in range(2):
                    layer.call(i, *calls[t][i])
            for i, c in enumerate(calls[t]):
                for layer in layers:
                    t0 = time.perf_counter()
                    layer.call(i, *c)
                    samples.setdefault((layer.name, layer.fmt, layer.threads, t, layer.bytes_per_expert), []).append(
                        time.perf_counter() - t0)
                machine.round()
            for layer in layers:
                v = samples[(layer.name, layer.fmt, layer.threads, t, layer.bytes_per_expert)]
                log(f"  {layer.name} {layer.fmt} {layer.threads}T: best {min(v) * 1e3:.2f} ms, "
                    f"median {statistics.median(v) * 1e3:.2f} ms")
        if not args.no_accuracy:
            for layer in layers:
                key = (layer.name, layer.fmt, layer.threads)
                if key not in errors and (layer.threads == max(threads) or layer in kt_layers):
                    errors[key] = accuracy(layer, src, args)
                    log(f"  {layer.name} {layer.fmt}: relative error vs fp32 {errors[key]:.4f}")
        for layer in kt_layers:
            layer.copies[0].worker.close()
            layer.copies.clear()
        gc.collect()

    limits = machine.limits
    rows = []
    for (name, fmt, n, t, bpe), times in samples.items():
        distinct = statistics.mean(len(torch.unique(ids)) for _, ids, _ in calls[t])
        bw, flops = limits[n]
        floor = max(distinct * bpe / bw, t * args.top_k * 3 * args.hidden * args.intermediate * 2 / flops)
        rows.append({"backend": name, "fmt": fmt, "threads": n, "tokens": t, "best": min(times),
                     "median": statistics.median(times), "floor": floor, "distinct": distinct,
                     "bytes": distinct * bpe, "samples": len(times)})
    text = report(args, argv, limits, rows, errors)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def report(args, argv, limits, rows, errors) -> str:
    lines = []
    add = lines.append
    cmd = "python benchmarks/bench_cpu_experts.py" + ("" if not argv and len(sys.argv) < 2 else " " + shlex.join(
        argv if argv is not None else sys.argv[1:]))
    add(f"Command: `{cmd}`\n")
    add(f"Layer: E={args.experts}, top-{args.top_k}, D={args.hidden}, I={args.intermediate}; weights cycled "
          f">= {args.cycle_gib} GiB per backend; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    add("Machine limits, best of the probes taken between rounds (torch.mv over 1 GiB fp32; bf16 matmul 2048^3):\n")
    add("| threads | read GB/s | bf16 GEMM GFLOP/s |\n|---|---|---|")
    for n, (bw, fl) in sorted(limits.items()):
        add(f"| {n} | {bw / 1e9:.1f} | {fl / 1e9:.0f} |")
    add("")

    def peer(name_prefix, fmt, t):
        cands = [r for r in rows if r["backend"].startswith(name_prefix) and r["fmt"] == fmt and r["tokens"] == t]
        return min(cands, key=lambda r: r["best"]) if cands else None

    add("| backend | format | threads | tokens | best ms | median ms | floor ms | x floor | GB/s | GFLOP/s "
          "| HF / this | kt bf16 / this | kt same fmt / this |")
    add("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["tokens"], r["backend"], r["fmt"], r["threads"])):
        t = r["tokens"]
        hf, ktb, ktf = peer("transformers", "bf16", t), peer("kt-kernel", "bf16", t), peer("kt-kernel", r["fmt"], t)
        ratio = (lambda p, r=r: f"{p['best'] / r['best']:.2f}" if p else "-")
        gflops = t * args.top_k * 3 * args.hidden * args.intermediate * 2 / r["best"] / 1e9
        add(f"| {r['backend']} | {r['fmt']} | {r['threads']} | {t} | {r['best'] * 1e3:.2f} | {r['median'] * 1e3:.2f} "
              f"| {r['floor'] * 1e3:.2f} | {r['best'] / r['floor']:.2f} | {r['bytes'] / r['best'] / 1e9:.1f} "
              f"| {gflops:.0f} | {ratio(hf)} | {ratio(ktb)} | {ratio(ktf)} |")
    if errors:
        add("\n| backend | format | threads | relative error vs fp32 (64 tokens) |\n|---|---|---|---|")
        for (name, fmt, n), err in errors.items():
            add(f"| {name} | {fmt} | {n} | {err:.4f} |")
    lines += goals(args, limits, rows, errors, peer)
    return "\n".join(lines)


def goals(args, limits, rows, errors, peer) -> list[str]:
    """The issue's goals, checked on this run's best times (tiermoe native at the largest thread count run)."""
    n = max(r["threads"] for r in rows)

    def ours(fmt, t):
        return next((r for r in rows if r["backend"].startswith("native") and r["fmt"] == fmt and r["tokens"] == t
                     and r["threads"] == n), None)

    out = ["", f"Goals (tiermoe native, {n} threads, best times of this run):", "", "| goal | measured | reached |",
           "|---|---|---|"]

    def goal(text, value, ok):
        out.append(f"| {text} | {value} | {'yes' if ok else 'no'} |")

    b1, b8, b512 = ours("bf16", 1), ours("bf16", 8), ours("bf16", 512)
    if b1:
        goal("decode 1 token bf16 within 1.4x of the bandwidth floor", f"{b1['best'] / b1['floor']:.2f}x",
             b1["best"] <= 1.4 * b1["floor"])
        for fmt, limit in (("int8", 0.6), ("int4", 0.4)):
            q = ours(fmt, 1)
            if q:
                goal(f"decode 1 token {fmt} at most {limit}x of bf16", f"{q['best'] / b1['best']:.2f}x",
                     q["best"] <= limit * b1["best"])
    if b8:
        goal("8 tokens bf16 within 1.5x of the floor of the distinct experts routed",
             f"{b8['best'] / b8['floor']:.2f}x", b8["best"] <= 1.5 * b8["floor"])
    if b512:
        rate = 512 * args.top_k * 3 * args.hidden * args.intermediate * 2 / b512["best"]
        goal("prefill 512 bf16 at least 60% of the bf16 GEMM rate", f"{rate / limits[n][1]:.0%}",
             rate >= 0.6 * limits[n][1])
        kt = peer("kt-kernel", "bf16", 512)
        if kt:
            goal("prefill 512 bf16 at least 1.5x kt-kernel AMX BF16", f"{kt['best'] / b512['best']:.2f}x",
                 kt["best"] >= 1.5 * b512["best"])
    for fmt, limit in (("bf16", 1e-2), ("int8", 1.5e-2), ("int4", 0.12)):
        err = next((e for (name, f, _), e in errors.items() if name.startswith("native") and f == fmt), None)
        if err is not None:
            goal(f"{fmt} relative error vs fp32 at most {limit}", f"{err:.4f}", err <= limit)
    for t, r in ((1, b1), (512, b512)):
        hf, kt = peer("transformers", "bf16", t), peer("kt-kernel", "bf16", t)
        if r and hf:
            goal(f"condition: {t} token(s) bf16 at least 1.5x faster than transformers", f"{hf['best'] / r['best']:.2f}x",
                 hf["best"] >= 1.5 * r["best"])
        if r and kt:
            goal(f"condition: {t} token(s) bf16 at least as fast as kt-kernel AMX BF16", f"{kt['best'] / r['best']:.2f}x",
                 kt["best"] >= r["best"])
    return out


if __name__ == "__main__":
    main()
