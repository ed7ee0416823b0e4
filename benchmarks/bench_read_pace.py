"""A decode token's big matrix-vector products against this machine's read rate, at every thread count, in one run.

A decode token of a large MoE model is bound by the bytes it reads: the LM head, the attention projections and its
active experts. For each thread count from 1 to the physical cores, on one kernel thread team of that size (pinned
as a model's team is; tiermoe.experts.native.kernel_team):
- the floor: a STREAM-style read of 1 GiB by the team's own threads (`tm_read_probe`, csrc/probes.cpp: each member
  takes 256 KiB chunks as the products take their tasks), best of 3 passes per round;
- one-row products of Qwen3-30B-A3B's shapes (--shape), each in bf16, int8, int4 and int6 (--formats; int6 is the
  4-bit model's head, attention output and experts' downs), each cycling
  through copies of at least --cycle-mib so no call finds its weights in cache: the LM head [151936, 2048], the
  attention's q, k and v stacked [5120, 2048] (one call, as the CPU-only decode makes it) and o [2048, 4096]
  (QuantizedLinear), and one MoE layer's 8 routed experts of 128 for one token (the CPU tier's kernels, random
  routing) - each one's read rate is its bytes read over its time, and its share of the floor;
- the team's wake-up cost: an empty job on every member after the team sat idle for 0.2, 2 and 20 ms, less the
  same call on a team of one (the caller's own cost of a call after a sleep).
Every row is timed in every round, in turn; the table gives the median and the spread (min-max) of --rounds
rounds of --calls calls each, and the share of the floor of the medians. The issue "Decode at the memory's pace"
asks >= 85% of the floor for every product at every thread count. --plot draws the shares.

    python benchmarks/bench_read_pace.py                                 # every product and format, 5 rounds
    python benchmarks/bench_read_pace.py --formats bf16 --products head,experts --rounds 7
    python benchmarks/bench_read_pace.py --threads 2 --plot pace.png --json pace.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support.decode_rounds import print_load_average

from tiermoe.experts.ffn import ExpertActivation
from tiermoe.experts.kernels import load_kernels
from tiermoe.experts.native import NativeCPUExperts, kernel_team
from tiermoe.experts.quant import FORMATS
from tiermoe.experts.threads import physical_cpus
from tiermoe.experts.tiers import CPUWorker
from tiermoe.experts.weights import ExpertWeights
from tiermoe.layers.quantized_linear import QuantizedLinear

# hidden, vocabulary, query heads x head dim, KV heads x head dim, experts, top-k, expert width
SHAPES = {
    "qwen3-30b-a3b": {"hidden": 2048, "vocab": 151936, "q": 4096, "kv": 512, "experts": 128, "top_k": 8, "inter": 768},
    "demo": {"hidden": 256, "vocab": 8192, "q": 256, "kv": 128, "experts": 16, "top_k": 4, "inter": 384},
}
PRODUCTS = ("head", "qkv", "o", "experts")
PROBE_BYTES = 1 << 30
GAPS_MS = (0.2, 2.0, 20.0)
FLOOR_GOAL = 0.85


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--formats", default="bf16,int8,int4,int6", help=f"comma-separated, of: {', '.join(FORMATS)}")
    p.add_argument("--products", default=",".join(PRODUCTS), help=f"comma-separated, of: {', '.join(PRODUCTS)}")
    p.add_argument("--threads", help="comma-separated team sizes (default: 1 to the physical cores)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; the median counts, the spread is shown (default 5)")
    p.add_argument("--calls", type=int, default=8, help="calls per row per round (default 8)")
    p.add_argument("--cycle-mib", type=int, default=512, help="bytes of copies each product cycles through (MiB)")
    p.add_argument("--plot", type=Path, help="draw each product's share of the floor per thread count here (PNG)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args(argv)
    args.formats = _choices(p, "--formats", args.formats, FORMATS)
    args.products = _choices(p, "--products", args.products, PRODUCTS)
    cores = len(physical_cpus())
    args.threads = list(range(1, cores + 1)) if args.threads is None else _thread_counts(p, args.threads, cores)
    for name in ("rounds", "calls", "cycle_mib"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def _choices(p: argparse.ArgumentParser, flag: str, text: str, allowed) -> list[str]:
    chosen = [c for c in text.split(",") if c]
    bad = [c for c in chosen if c not in allowed]
    if bad or not chosen:
        p.error(f"{flag}: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(allowed)}")
    return chosen


def _thread_counts(p: argparse.ArgumentParser, text: str, cores: int) -> list[int]:
    try:
        counts = sorted({int(t) for t in text.split(",") if t})
    except ValueError:
        p.error(f"--threads takes comma-separated whole numbers, got '{text}'")
    if not counts or counts[0] < 1 or counts[-1] > cores:
        p.error(f"--threads: each count from 1 to this machine's {cores} physical cores, got '{text}'")
    return counts


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Row:
    """One product in one format: `call()` runs it once on the next copy; `nbytes` is what one call reads."""

    def __init__(self, product: str, fmt: str, calls, nbytes: int):
        self.product, self.fmt, self.calls, self.nbytes = product, fmt, calls, nbytes
        self._next = 0

    def call(self) -> None:
        self.calls[self._next % len(self.calls)]()
        self._next += 1


def linear_rows(shape: dict, product: str, fmt: str, args, team) -> Row:
    """Copies of one packed linear (random N(0, 0.02) weights), called with one bf16 row."""
    n, k = {"head": (shape["vocab"], shape["hidden"]), "qkv": (shape["q"] + 2 * shape["kv"], shape["hidden"]),
            "o": (shape["hidden"], shape["q"])}[product]
    linears = []
    while not linears or len(linears) * linears[0].packed.q.nbytes < args.cycle_mib << 20:
        dense = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        nn.init.normal_(dense.weight, std=0.02)
        linears.append(QuantizedLinear(dense, fmt, load_kernels(), team))
    x = torch.randn(1, k, dtype=torch.bfloat16)
    return Row(product, fmt, [lambda lin=lin: lin(x) for lin in linears], linears[0].packed.q.nbytes)


def expert_row(shape: dict, fmt: str, args, worker: CPUWorker, threads: int) -> Row:
    """One MoE layer's experts on the CPU tier; each call routes one token to top-k distinct random experts."""
    d, i, e, top_k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    layers = []
    while not layers or len(layers) * layers[0].nbytes < args.cycle_mib << 20:
        tier = NativeCPUExperts(worker, ExpertActivation("silu_glu"), fmt, torch.bfloat16, threads)
        for expert in range(e):
            tier.add(expert, ExpertWeights(torch.randn(2 * i, d, dtype=torch.bfloat16) * 0.02,
                                           torch.randn(d, i, dtype=torch.bfloat16) * 0.02))
        layers.append(tier)
    x, weights = torch.randn(1, d, dtype=torch.bfloat16), torch.full((1, top_k), 1.0 / top_k)
    g = torch.Generator().manual_seed(0)

    def call(tier) -> None:
        ids = torch.randperm(e, generator=g)[:top_k].view(1, top_k)
        tier.compute_here(x, ids, weights)

    return Row("experts", fmt, [lambda t=t: call(t) for t in layers], layers[0].nbytes * top_k // e)


def wake_cost_us(team, solo, gap_ms: float, calls: int) -> float:
    """Median extra time of an empty job on every member after `gap_ms` idle, over the same on a team of one."""
    def median_call(t) -> float:
        times = []
        for _ in range(calls):
            time.sleep(gap_ms / 1e3)
            start = time.perf_counter()
            t.empty_job()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return max(0.0, median_call(team) - median_call(solo)) * 1e6


def time_row(row: Row, calls: int) -> float:
    """Seconds per call, the mean of `calls` calls (one warm-up call first)."""
    row.call()
    start = time.perf_counter()
    for _ in range(calls):
        row.call()
    return (time.perf_counter() - start) / calls


def measure(args) -> dict:
    shape = SHAPES[args.shape]
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels are unavailable here (no C++ compiler, or TIERMOE_CPU_ISA=torch): "
                         "nothing to measure")
    torch.set_num_threads(1)  # the products run on the team; torch only makes the inputs
    worker = CPUWorker()
    probe_buffer = torch.ones(PROBE_BYTES // 8, dtype=torch.int64)
    solo = kernel_team(worker, kernels, 1)
    out = {"shape": args.shape, "isa": kernels.isa_name, "threads": {}}
    try:
        for n in args.threads:
            team = kernel_team(worker, kernels, n)
            log(f"{n} thread(s): making {len(args.products) * len(args.formats)} rows")
            rows = [expert_row(shape, fmt, args, worker, n) if product == "experts"
                    else linear_rows(shape, product, fmt, args, lambda t=team: t)
                    for product in args.products for fmt in args.formats]
            probes, times = [], {(r.product, r.fmt): [] for r in rows}
            wake = {gap: [] for gap in GAPS_MS}
            for r in range(args.rounds):
                probes.append(PROBE_BYTES / team.read_seconds(probe_buffer, 3))
                for row in rows:
                    times[(row.product, row.fmt)].append(time_row(row, args.calls))
                for gap in GAPS_MS:
                    if n > 1:  # a team of one has no helper to wake
                        wake[gap].append(wake_cost_us(team, solo, gap, 21))
                log(f"  round {r + 1}/{args.rounds}: floor {statistics.median(probes) / 1e9:.1f} GB/s")
            out["threads"][n] = {
                "probe_gb_s": [p / 1e9 for p in probes],
                "rows": [{"product": row.product, "format": row.fmt, "bytes": row.nbytes,
                          "seconds": times[(row.product, row.fmt)]} for row in rows],
                "wake_us": {str(gap): wake[gap] for gap in GAPS_MS}}
            del rows
    finally:
        worker.close()
    return out


def _spread(values: list[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    return f"{statistics.median(values) * scale:{fmt}} ({min(values) * scale:{fmt}}-{max(values) * scale:{fmt}})"


def shares(result: dict) -> list[tuple[int, str, str, float, float]]:
    """(threads, product, format, GB/s of the median time, share of the median floor) for every row."""
    out = []
    for n, at in result["threads"].items():
        floor = statistics.median(at["probe_gb_s"])
        for row in at["rows"]:
            rate = row["bytes"] / statistics.median(row["seconds"]) / 1e9
            out.append((int(n), row["product"], row["format"], rate, rate / floor))
    return out


def report(result: dict) -> str:
    lines = [f"shape {result['shape']}, kernels {result['isa']}", "",
             "| threads | floor GB/s (read probe) | product | format | MB read | us per call | GB/s | of floor |",
             "|---|---|---|---|---|---|---|---|"]
    by_row = {(n, p, f): (rate, share) for n, p, f, rate, share in shares(result)}
    for n, at in result["threads"].items():
        floor = _spread(at["probe_gb_s"])
        for row in at["rows"]:
            rate, share = by_row[(int(n), row["product"], row["format"])]
            lines.append(f"| {n} | {floor} | {row['product']} | {row['format']} | {row['bytes'] / 1e6:.1f} | "
                         f"{_spread(row['seconds'], 1e6, '.0f')} | {rate:.1f} | {share:.0%} |")
    lines += ["", "| threads | " + " | ".join(f"wake-up after {gap:g} ms idle, us" for gap in GAPS_MS) + " |",
              "|---|" + "---|" * len(GAPS_MS)]
    for n, at in result["threads"].items():
        lines.append(f"| {n} | " + " | ".join(_spread(at["wake_us"][str(g)], 1, ".0f") if at["wake_us"][str(g)]
                                               else "-" for g in GAPS_MS) + " |")
    below = [(n, p, f, s) for n, p, f, _, s in shares(result) if s < FLOOR_GOAL]
    worst = min(shares(result), key=lambda s: s[4])
    verdict = "met" if not below else f"NOT MET ({len(below)} of {len(shares(result))} rows below)"
    lines += ["", (f"goal: every product >= {FLOOR_GOAL:.0%} of the read probe at every thread count: {verdict}; "
                  f"lowest {worst[1]} {worst[2]} at {worst[0]} thread(s), {worst[4]:.0%}")]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = shares(result)
    labels = sorted({(p, f) for _, p, f, _, _ in rows})
    threads = sorted({n for n, *_ in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 4))
    width = 0.8 / len(threads)
    for j, n in enumerate(threads):
        values = {(p, f): s for m, p, f, _, s in rows if m == n}
        ax.bar([i + j * width for i in range(len(labels))], [values[lab] * 100 for lab in labels], width,
               label=f"{n} thread(s)")
    ax.axhline(FLOOR_GOAL * 100, color="black", linestyle="--", linewidth=1, label=f"goal {FLOOR_GOAL:.0%}")
    ax.set_xticks([i + width * (len(threads) - 1) / 2 for i in range(len(labels))],
                  [f"{p}\n{f}" for p, f in labels])
    ax.set_ylabel("read rate, % of the read probe")
    ax.set_title(f"Decode products against the read floor ({result['shape']}, {result['isa']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def main(argv=None) -> None:
    args = parse_args(argv)
    print_load_average("before")
    result = measure(args)
    print_load_average("after")
    print(report(result))
    if args.plot:
        plot(result, args.plot)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
