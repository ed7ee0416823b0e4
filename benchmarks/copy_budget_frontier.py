"""What a bigger copy budget buys: hit rate against estimated tokens/s, per budget, from `bench_cross_task.py` runs.

The per-window oracle of issue 23 places every 32-token window's experts in hindsight with free copies. Belady's
cache knows the future too but pays for its copies; replayed at several copy budgets (one `bench_cross_task.py
--copy-budget B --out FILE` run each) it shows how much of the oracle's hit rate a policy can buy and what the
copies cost in estimated tokens/s. This script reads those runs and prints, per GPU ratio and budget, the mean over
the cross-task pairs of each policy's hit rate and tokens/s, and plots the frontier.

    for b in 1 2 4 8 16 32; do
      PYTHONPATH=$PWD python benchmarks/bench_cross_task.py --data data/routing/esft-deepseek-v2-lite \\
          --profiles rtx4090 --ratios 0.1,0.2,0.3,0.4 --policies lfu,adaptive,belady,oracle-window \\
          --pairs intent:law,intent:summary,law:intent,law:summary,summary:intent,summary:law \\
          --copy-budget $b --out scratch/frontier_b$b.json
    done
    python benchmarks/copy_budget_frontier.py scratch/frontier_b*.json --markdown frontier.md --plot frontier.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

POLICIES = ("lfu", "adaptive", "belady")


def load(paths: list[str]) -> tuple[dict, list[int], list[float]]:
    """{(policy, budget, ratio): (mean hit rate, mean tokens/s)} over the cross-task pairs of each run (runs of one
    GPU profile)."""
    cells: dict[tuple, list[dict]] = {}
    for path in paths:
        run = json.loads(Path(path).read_text())
        for row in run["rows"]:
            if row["calibration"] != row["replayed"]:
                cells.setdefault((row["policy"], run["copy_budget"], row["gpu_ratio"]), []).append(row)
    profiles = {row["gpu_profile"] for rows in cells.values() for row in rows}
    if len(profiles) > 1:  # their tokens/s are estimates for different GPUs: a mean of both would be neither's
        raise ValueError(f"the runs hold GPU profiles {sorted(profiles)}; give runs of one profile")
    means = {key: (sum(r["hit_rate"] for r in rows) / len(rows),
                   sum(r["estimated_output_tokens_per_s"] for r in rows) / len(rows)) for key, rows in cells.items()}
    budgets = sorted({b for _, b, _ in means})
    ratios = sorted({r for _, _, r in means})
    return means, budgets, ratios


def table(means: dict, budgets: list[int], ratios: list[float]) -> str:
    lines = ["| ratio | oracle-window hit | copy budget | " + " | ".join(f"{p}: hit / tok/s" for p in POLICIES) + " |",
             "|---|---|---|" + "---|" * len(POLICIES)]
    for ratio in ratios:
        oracle = means.get(("oracle-window", budgets[0], ratio), (float("nan"),))[0]
        for b in budgets:
            cells = [f"{means[(p, b, ratio)][0]:.1%} / {means[(p, b, ratio)][1]:.2f}" if (p, b, ratio) in means
                     else "-" for p in POLICIES]
            lines.append(f"| {ratio:.1f} | {oracle:.1%} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(means: dict, budgets: list[int], ratios: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ratios), figsize=(4.2 * len(ratios), 4), squeeze=False)
    for ax, ratio in zip(axes[0], ratios):
        for policy, marker in zip(POLICIES, "soD"):
            pts = [(means[(policy, b, ratio)], b) for b in budgets if (policy, b, ratio) in means]
            ax.plot([m[1] for m, _ in pts], [100 * m[0] for m, _ in pts], marker=marker, label=policy)
            if policy == "belady":  # its points labelled with their budget
                for (hit, tps), b in pts:
                    ax.annotate(str(b), (tps, 100 * hit), fontsize=7, xytext=(3, 3), textcoords="offset points")
        oracle = means.get(("oracle-window", budgets[0], ratio))
        if oracle:
            ax.axhline(100 * oracle[0], linestyle="--", color="grey", label="oracle-window hit")
            ax.axhline(100 * oracle[0] - 10, linestyle=":", color="grey", label="oracle - 10 points")
        ax.set_title(f"GPU ratio {ratio:.1f}")
        ax.set_xlabel("estimated tokens/s")
        ax.set_ylabel("GPU hit rate, %")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Copy budget (labels: swaps per step) against hit rate and tokens/s, mean of 6 cross-task pairs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="bench_cross_task.py --out files, one per copy budget")
    ap.add_argument("--markdown", help="also write the table here")
    ap.add_argument("--plot", help="also plot the frontier here (PNG)")
    args = ap.parse_args()
    try:
        means, budgets, ratios = load(args.runs)
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"copy_budget_frontier: {err}: expected bench_cross_task.py --out files") from None
    if not means:
        raise SystemExit("copy_budget_frontier: no cross-task rows in these runs")
    text = table(means, budgets, ratios)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.plot:
        plot(means, budgets, ratios, args.plot)


if __name__ == "__main__":
    main()
