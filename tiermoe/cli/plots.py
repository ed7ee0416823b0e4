"""The figures commands draw with --plot: a plan's heatmap (place), a statistics file's skew and strategy hit
rates (stats), and the placement and trace-replay benchmarks (bench); and fine-tuning's loss curve (finetune).

matplotlib loads only when a figure is asked for (with the Agg backend, chosen before pyplot loads: no display
is needed), so commands without --plot do not pay for it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiermoe.analysis.dynamic_bench import DynamicBenchResult
from tiermoe.analysis.placement_result import PlacementBenchResult
from tiermoe.analysis.trace_replay import ORACLES
from tiermoe.placement.plan import PlacementPlan


def _pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_plan(plan: PlacementPlan, path: str | Path, counts=None, title: str = "") -> Path:
    """Heatmap layers x experts: colour = share of the layer's activations (or 1 without statistics);
    GPU experts outlined (coloured per GPU rank when there are several)."""
    plt = _pyplot()
    if counts is not None:
        counts = torch.as_tensor(counts, dtype=torch.float64)
        share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1e-300)
    else:
        share = torch.zeros(plan.num_layers, plan.num_experts, dtype=torch.float64)
    width = min(18, 3 + plan.num_experts * 0.12)
    height = min(14, 2 + plan.num_layers * 0.25)
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(share.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="share of the layer's routed tokens" if counts is not None else "no statistics")
    colours = plt.get_cmap("tab10")
    for rank in range(plan.num_gpus):
        layers, experts = (plan.assignment == rank).nonzero(as_tuple=True)
        ax.scatter(experts.numpy(), layers.numpy(), marker="s", s=12, facecolors="none",
                   edgecolors=[colours(rank % 10)], linewidths=0.8,
                   label=f"GPU {rank}" if plan.num_gpus > 1 else "GPU tier")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title or f"{plan.strategy}: {int(plan.mask.sum())} GPU experts")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_report(r: dict, path: str | Path) -> Path:
    """Left: expected GPU hit rate of each strategy at GPU ratios 10%..90%. Right: per-layer Gini and top-20% share."""
    plt = _pyplot()
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


def plot_bench(bench: DynamicBenchResult, path: str, title: str) -> None:
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for policy in bench.policies:
        style = ":" if policy in ORACLES else "-"
        ys = [bench.get(policy, r) for r in bench.ratios]
        ax1.plot(bench.ratios, [100 * y["hit_rate"] for y in ys], style, marker="o", label=policy)
        ax2.plot(bench.ratios, [y["estimated_output_tokens_per_s"] or 0 for y in ys], style, marker="o", label=policy)
    ax1.set(xlabel="GPU expert ratio", ylabel="GPU hit rate (%)", title="hit rate (measured on the trace)")
    ax2.set(xlabel="GPU expert ratio", ylabel="output tokens/s (estimate)", title="throughput (cost-model estimate)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_placement_bench(result: PlacementBenchResult, path: str) -> None:
    """Output tokens/s against ratio per strategy, and hit rate beside it."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    xs = [100 * r for r in result.ratios]
    for strategy in result.strategies:
        cells = [result.get(strategy, r) for r in result.ratios]
        style = "--" if strategy in ("dynamic", "adaptive") else "-"
        ax1.plot(xs, [c.output_tokens_per_s for c in cells], style, marker="o", label=strategy)
        ax2.plot(xs, [100 * c.hit_rate for c in cells], style, marker="o", label=strategy)
    estimate = " (ESTIMATE)" if result.estimated else " (measured)"
    ax1.set(xlabel="GPU expert ratio (%)", ylabel="output tokens/s" + estimate, title="throughput" + estimate)
    ax2.set(xlabel="GPU expert ratio (%)", ylabel="GPU-tier hit rate (%)", title="GPU-tier hit rate (exact)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)  # differences drawn to scale
    ax1.legend(fontsize=8)
    setup = result.setup
    fig.suptitle(f"tiermoe bench placement: {setup.get('model_name', '?')}, {setup.get('dataset', '?')}, "
                 f"GPU profile {result.gpu_profile.get('name', '?')}" + (" - throughput is a cost-model ESTIMATE"
                                                                          if result.estimated else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss_curve(history: list[dict], evals: list[dict], path: str | Path, title: str = "") -> Path:
    """Training loss per step (faint) with its moving average, and the held-out loss where it was measured."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if history:
        steps = [h["step"] for h in history]
        losses = [h["loss"] for h in history]
        window = max(1, min(25, len(losses) // 10))
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="training batch loss")
        ax.plot(steps, smooth, color="tab:blue", label=f"training loss ({window}-step mean)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], color="tab:red", marker="o",
                label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy on reply tokens (nats)")
    ax.set_title(title or "fine-tuning")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
