"""When a kernel job is worth the team: one packed product alone on the caller against shared with a helper.

A team's helpers sleep after a short spin, and a decode step's calls are further apart than that, so a shared job
first waits for a helper to wake. This times one packed bf16 product (`QuantizedLinear`, 1,024 inputs, as many
outputs as the weight size asks) on a team of two that runs every job on its caller (`solo_bytes` above any job)
and on one that shares every job (`solo_bytes=0`), with a pause between calls (`--gap-us`) as a step's Python
leaves one; median of `--calls` calls each. `tiermoe.experts.kernels.SOLO_BYTES` is chosen from this table.

    python benchmarks/bench_team_solo.py
    python benchmarks/bench_team_solo.py --sizes-kb 512 4096 --rows 1 8 --gap-us 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

from tiermoe.experts.kernels import SOLO_BYTES, ThreadTeam, load_kernels
from tiermoe.experts.threads import team_cpus
from tiermoe.layers.quantized_linear import QuantizedLinear

IN_FEATURES = 1024


def time_product(linear: nn.Linear, team: ThreadTeam, kernels, x: torch.Tensor, calls: int, gap_s: float) -> float:
    """Median seconds of one product, `gap_s` after the last."""
    product = QuantizedLinear(linear, "bf16", kernels, lambda: team)
    product(x)
    times = []
    for _ in range(calls):
        time.sleep(gap_s)
        start = time.perf_counter()
        product(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-kb", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096, 8192, 16384],
                   help="bf16 weight sizes, KiB")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows of activations per product")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--gap-us", type=int, default=500, help="pause before each call (a step's Python between calls)")
    args = p.parse_args()
    if min(args.sizes_kb) < 32 or min(args.rows) < 1 or args.calls < 1 or args.gap_us < 0:
        p.error("sizes >= 32 KiB, rows >= 1, calls >= 1 and a gap >= 0 are needed")
    if max(args.sizes_kb) > 1 << 20:
        p.error("sizes up to 1 GiB")
    kernels = load_kernels()
    if kernels is None:
        sys.exit("the kernel library is unavailable (no compiler, or TIERMOE_CPU_ISA=torch): nothing to time")
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs; "
          f"SOLO_BYTES = {SOLO_BYTES >> 10} KiB", flush=True)
    torch.set_num_threads(1)
    alone = ThreadTeam(kernels, 2, team_cpus(2), solo_bytes=1 << 62)
    shared = ThreadTeam(kernels, 2, team_cpus(2), solo_bytes=0)
    print("| weights, KiB | rows | alone, us | shared, us | shared / alone |\n|---|---|---|---|---|", flush=True)
    for kb in args.sizes_kb:
        linear = nn.Linear(IN_FEATURES, max(16, kb * 1024 // 2 // IN_FEATURES), bias=False)
        for rows in args.rows:
            x = torch.randn(rows, IN_FEATURES).bfloat16()
            a, s = (time_product(linear, team, kernels, x, args.calls, args.gap_us / 1e6) for team in (alone, shared))
            print(f"| {kb} | {rows} | {a * 1e6:.0f} | {s * 1e6:.0f} | {s / a:.2f} |", flush=True)
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    alone.close()
    shared.close()


if __name__ == "__main__":
    main()
