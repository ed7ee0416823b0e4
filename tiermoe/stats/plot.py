"""The `tiermoe stats --plot` figure: hit rate per placement strategy vs GPU-tier share, and per-layer skew."""

from __future__ import annotations

from pathlib import Path


def plot_report(r: dict, path: str | Path) -> Path:
    """Left: expected GPU hit rate of each strategy at GPU ratios 10%..90%. Right: per-layer Gini and top-20% share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    hits = r["hit_rates"]
    ratios = [100 * x for x in hits["ratios"]]
    styles = ["-", "--", "-.", ":"]
    for i, (name, rates) in enumerate(hits["strategies"].items()):  # dashes keep coinciding lines visible
        left.plot(ratios, [100 * v for v in rates], marker="o", linestyle=styles[i % 4], label=name)
    left.plot(ratios, ratios, color="grey", linewidth=0.8, label="no skew (hit = share)")
    left.set_xlabel("routed experts on the GPU tier (%)")
    left.set_ylabel("expected GPU hit rate (%)")
    left.set_title("placement strategies" + (" (in-sample)" if isinstance(hits["evaluated_on"], str) else
                                             " (held-out evaluation)"))
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    layers = [row["layer"] for row in r["layers"]]
    right.bar(layers, [row["gini"] for row in r["layers"]], color="tab:blue", label="Gini")
    right.plot(layers, [row["top20_share"] for row in r["layers"]], color="tab:orange", marker=".",
               label="top-20% experts' share")
    right.set_xlabel("layer")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_ylim(0, 1)
    right.set_title("routing skew per MoE layer")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(", ".join(Path(s).name for s in r["sources"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
