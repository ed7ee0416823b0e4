"""Issue check for dynamic placement: adaptive against every static strategy and KT-compatible dynamic.

For each evaluation trace (eval_<A>.pt) and each calibration (cal_<A>.pt: same dataset, cal_<B>.pt: the other),
replays every policy at GPU ratios 0.1..0.9 (tiermoe bench dynamic's code path) and checks:
  1. adaptive's estimated time (copies charged) <= every static strategy's and kt-dynamic's, at every ratio;
  2. at ratios 0.1-0.4, adaptive's hit rate >= 1.10 x frequency's hit rate calibrated on the OTHER dataset.
Prints one markdown table per pairing, the verdicts, and writes a plot of adaptive vs frequency.

    python benchmarks/check_dynamic.py --traces scratch/traces --datasets sharegpt,gsm8k --plot dynamic_check.png
"""

from __future__ import annotations

import argparse
import json

import torch

from tiermoe.analysis.dynamic_bench import DEFAULT_RATIOS, replay_cost_model, run_dynamic_bench
from tiermoe.analysis.trace_replay import trace_passes
from tiermoe.arch import detect, load_config
from tiermoe.bundled import resolve_model
from tiermoe.placement.profiles import load_profile
from tiermoe.stats.io import load_counts

STATIC = ("uniform", "front-loading", "random", "frequency", "balanced")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", required=True, help="folder with eval_<dataset>.pt and cal_<dataset>.pt")
    ap.add_argument("--datasets", default="sharegpt,gsm8k", help="exactly two dataset names")
    ap.add_argument("--gpu-profile", default="rtx4090")
    ap.add_argument("--prefill-threshold", type=int, default=None)
    ap.add_argument("--plot", help="PNG: adaptive and frequency hit rate and time per pairing")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    a, b = args.datasets.split(",")
    spec = detect(load_config(resolve_model(None)))
    cost = replay_cost_model(spec, load_profile(args.gpu_profile))  # `tiermoe bench dynamic`'s defaults
    ratios = list(DEFAULT_RATIOS)
    results, all_ok = {}, True
    for ev, other in ((a, b), (b, a)):
        passes = trace_passes(torch.load(f"{args.traces}/eval_{ev}.pt", map_location="cpu", weights_only=True))
        benches = {cal: run_dynamic_bench(passes, cost, ratios, load_counts(f"{args.traces}/cal_{cal}.pt",
                   passes.num_layers, passes.num_experts), args.prefill_threshold) for cal in (ev, other)}
        for cal, bench in benches.items():
            results[(ev, cal)] = bench
            print(f"\n### eval {ev}, calibration {cal}\n")
            print(f"| ratio | best static (time) | kt-dynamic hit | frequency hit | frequency(cal {other}) hit | "
                  "adaptive hit | oracle-window hit | best static+kt tok/s | adaptive tok/s | adaptive swaps | time ok "
                  "| hit +10% |")
            print("|---" * 12 + "|")
            for r in ratios:
                rivals = {p: bench.get(p, r) for p in STATIC + ("kt-dynamic",)}
                best = min(rivals, key=lambda p: rivals[p]["estimated_seconds"])
                ad = bench.get("adaptive", r)
                time_ok = ad["estimated_seconds"] <= rivals[best]["estimated_seconds"] * (1 + 1e-12)
                f_other = benches[other].get("frequency", r)["hit_rate"]
                hit_ok = None if r > 0.4 + 1e-9 else ad["hit_rate"] >= 1.10 * f_other
                all_ok &= time_ok and hit_ok is not False
                print(f"| {r:.1f} | {best} | {rivals['kt-dynamic']['hit_rate']:.1%} | "
                      f"{rivals['frequency']['hit_rate']:.1%} | {f_other:.1%} | {ad['hit_rate']:.1%} | "
                      f"{bench.get('oracle-window', r)['hit_rate']:.1%} | "
                      f"{rivals[best]['estimated_output_tokens_per_s']:.0f} | "
                      f"{ad['estimated_output_tokens_per_s']:.0f} | {ad['swaps']} | {'yes' if time_ok else 'NO'} | "
                      f"{'-' if hit_ok is None else ('yes' if hit_ok else 'NO')} |")
    print(f"\nall checks pass: {all_ok}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"eval_{ev}/cal_{cal}": bench.rows for (ev, cal), bench in results.items()}, f, indent=1)
    if args.plot:
        plot(results, ratios, args.plot)
    return 0 if all_ok else 1


def plot(results, ratios, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(4.2 * len(results), 8), squeeze=False)
    for col, ((ev, cal), bench) in enumerate(results.items()):
        for policy, style in (("frequency", "-"), ("balanced", "--"), ("uniform", "--"), ("front-loading", "--"),
                              ("kt-dynamic", "-"), ("adaptive", "-"),
                              ("oracle-static", ":"), ("oracle-window", ":")):
            rows = [bench.get(policy, r) for r in ratios]
            axes[0][col].plot(ratios, [100 * x["hit_rate"] for x in rows], style, marker="o", ms=3, label=policy)
            freq = [bench.get("frequency", r)["estimated_seconds"] for r in ratios]
            axes[1][col].plot(ratios, [100 * (f / x["estimated_seconds"] - 1) for f, x in zip(freq, rows)], style,
                              marker="o", ms=3, label=policy)
        axes[0][col].set(title=f"eval {ev}, cal {cal}", xlabel="GPU expert ratio", ylabel="GPU hit rate (%)")
        axes[1][col].set(xlabel="GPU expert ratio", ylabel="est. speed vs frequency (%)")
        for ax in (axes[0][col], axes[1][col]):
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
