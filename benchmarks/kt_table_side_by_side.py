"""Our real-size strategies x ratio tables beside the one KTransformers publishes (issue 23).

KTransformers' expert-scheduling tutorial (kt-kernel `doc/en/kt-kernel/experts-sched-Tutorial.md`, lines 174-190;
summarised in ../shared/reference/ktransformers-behaviour.md, section 9) gives output tokens/s of Qwen3-Next-80B-A3B
FP8 on 4x RTX 4090 with a Xeon Gold 6454S, TP=4, ShareGPT prompts, for random / uniform / front-loading /
frequency / its dynamic update at GPU expert ratios 0-100%. Its machine, model and prompts are not ours, so the
tokens/s cannot be compared; what can be is each table's shape. Every cell is divided by the table's frequency
cell at 0% (all experts on the CPU tier, prompts prefilled there too), which gives the speed-up a strategy buys at
each ratio (dynamic and adaptive also prefill long prompts layerwise on the GPU, so they start above 1), and each
strategy is set against the best static strategy of the same table.

Reads `tiermoe bench placement --out` files (each labelled LABEL=FILE) and prints the side-by-side tables; `--plot`
draws the speed-ups.

    python benchmarks/kt_table_side_by_side.py \\
        "ESFT law, DeepSeek-V2-Lite experts, RTX 4090 (estimate)=benchmarks/results/placement_esft_law_rtx4090.json" \\
        --markdown benchmarks/results/kt_table_side_by_side.md --plot benchmarks/results/kt_table_side_by_side.png
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

KT_SOURCE = ("KTransformers experts-sched tutorial: Qwen3-Next-80B-A3B FP8, 4x RTX 4090, Xeon Gold 6454S, TP=4, "
             "ShareGPT (measured)")
KT_RATIOS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# output tokens/s per strategy, at KT_RATIOS
KT_TABLE = {
    "random": (53.01, 56.63, 58.75, 62.86, 66.81, 70.38, 71.33, 74.40, 79.71, 88.82, 112.61),
    "uniform": (52.96, 56.57, 60.28, 62.08, 66.82, 65.25, 72.80, 76.17, 79.20, 81.06, 112.32),
    "front-loading": (54.18, 57.18, 58.82, 63.87, 67.45, 73.65, 77.95, 81.59, 89.20, 98.14, 111.82),
    "frequency": (52.72, 58.60, 61.92, 66.50, 72.78, 76.19, 82.33, 89.37, 100.67, 107.15, 114.26),
    "dynamic": (53.37, 70.22, 74.73, 75.55, 80.98, 81.17, 82.30, 88.70, 92.31, 95.04, 112.99),
}
STATIC = ("random", "uniform", "front-loading", "frequency", "balanced")
SHOWN = ("random", "uniform", "front-loading", "frequency", "dynamic", "adaptive")


def kt_table() -> dict:
    return {(s, r): v for s, row in KT_TABLE.items() for r, v in zip(KT_RATIOS, row)}


def our_table(path: str) -> tuple[dict, str]:
    """{(strategy, ratio): output tokens/s} of one `bench placement --out` file, and how it was obtained."""
    run = json.loads(Path(path).read_text())
    cells = {(c["strategy"], round(c["ratio"], 2)): c["output_tokens_per_s"] for c in run["cells"]}
    kind = "estimate" if run.get("estimated") else "measured"
    return cells, f"{kind}, profile {run.get('gpu_profile', {}).get('name')}"


def speedups(cells: dict) -> dict:
    """Each cell over the table's all-on-CPU cell (frequency at 0%)."""
    base = cells[("frequency", 0.0)]
    return {key: v / base for key, v in cells.items()}


def best_static(cells: dict, ratio: float) -> tuple[str, float]:
    options = [(cells[(s, ratio)], s) for s in STATIC if (s, ratio) in cells]
    value, name = max(options)
    return name, value


def side_by_side(tables: list[tuple[str, dict]]) -> str:
    """One table per source: tokens/s and speed-up over 0% per strategy, and each dynamic strategy against the best
    static strategy at that ratio."""
    out = []
    for label, cells in tables:
        strategies = [s for s in SHOWN if (s, 0.0) in cells]
        ratios = sorted({r for _, r in cells})
        up = speedups(cells)
        out += [f"\n**{label}**: output tokens/s (speed-up over frequency at 0%: every expert on the CPU tier)\n",
                "| GPU ratio | " + " | ".join(strategies) + " | best static | dynamic vs best static | "
                "adaptive vs best static |", "|---" * (len(strategies) + 4) + "|"]
        for r in ratios:
            row = [f"{cells[(s, r)]:.1f} ({up[(s, r)]:.2f}x)" if (s, r) in cells else "-" for s in strategies]
            name, value = best_static(cells, r)
            vs = [f"{cells[(s, r)] / value - 1:+.1%}" if (s, r) in cells else "-" for s in ("dynamic", "adaptive")]
            out.append(f"| {r:.0%} | " + " | ".join(row) + f" | {name} | " + " | ".join(vs) + " |")
    return "\n".join(out)


def shape_summary(tables: list[tuple[str, dict]]) -> str:
    """The features of each table's shape that compare across machines, one line per table."""
    lines = ["\n| table | frequency over random, 10-50% | frequency over random, 60-90% | all on GPU over all on CPU "
             "(frequency) | dynamic over frequency, 10-40% | adaptive over best static, 10-90% | adaptive over dynamic, "
             "10-90% |", "|---|---|---|---|---|---|---|"]
    for label, cells in tables:
        def gain(a, b, ratios):
            values = [cells[(a, r)] / cells[(b, r)] - 1 for r in ratios if (a, r) in cells and (b, r) in cells]
            return f"{min(values):+.1%} to {max(values):+.1%}" if values else "-"
        middle = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
        adaptive = [cells[("adaptive", r)] / best_static(cells, r)[1] - 1 for r in middle if ("adaptive", r) in cells]
        full = cells.get(("frequency", 1.0), 0) / cells[("frequency", 0.0)]
        lines.append(f"| {label} | {gain('frequency', 'random', (0.1, 0.2, 0.3, 0.4, 0.5))} | "
                     f"{gain('frequency', 'random', (0.6, 0.7, 0.8, 0.9))} | {full:.2f}x | "
                     f"{gain('dynamic', 'frequency', (0.1, 0.2, 0.3, 0.4))} | "
                     + (f"{min(adaptive):+.1%} to {max(adaptive):+.1%}" if adaptive else "-") + " | "
                     + gain("adaptive", "dynamic", middle) + " |")
    return "\n".join(lines)


def plot(tables: list[tuple[str, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = -(-len(tables) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.4 * rows), squeeze=False)
    for ax in axes.flat[len(tables):]:
        ax.set_visible(False)
    for ax, (label, cells) in zip(axes.flat, tables):
        up = speedups(cells)
        for s in SHOWN:
            ratios = sorted(r for (x, r) in up if x == s)
            if ratios:
                ax.plot([100 * r for r in ratios], [up[(s, r)] for r in ratios], marker="o", ms=3, label=s)
        ax.set_title("\n".join(textwrap.wrap(label, 70)), fontsize=8)
        ax.set_xlabel("GPU expert ratio (%)")
        ax.set_ylabel("output tokens/s over all experts on the CPU")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=FILE", help="a `tiermoe bench placement --out` file, labelled")
    ap.add_argument("--markdown")
    ap.add_argument("--plot")
    args = ap.parse_args()
    tables = [(KT_SOURCE, kt_table())]
    for spec in args.runs:
        label, sep, path = spec.rpartition("=")
        if not sep or not label:
            raise SystemExit(f"'{spec}': give LABEL=FILE")
        cells, how = our_table(path)
        tables.append((f"{label} ({how})", cells))
    text = side_by_side(tables) + "\n" + shape_summary(tables)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text.lstrip() + "\n")
    if args.plot:
        plot(tables, args.plot)


if __name__ == "__main__":
    main()
