"""The figures commands draw with --plot: a plan's heatmap (place), a statistics file's skew and strategy hit
rates (stats), and the placement and trace-replay benchmarks (bench); and fine-tuning's loss curve (finetune).

matplotlib loads only when a figure is asked for (with the Agg backend, chosen before pyplot loads: no display
is needed), so commands without --plot do not pay for it.

Every legend sits outside the axes (a figure legend in the constrained layout's margin), so it never hides a
marker; value axes fit their data unless the scale itself means something (shares and hit rates, 0-1 / 0-100%),
so differences between strategies are visible rather than flat lines near the top of a range from zero. Each
plot has a `*_figure` function that builds the figure (tests inspect it) and a `plot_*` one that saves it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiermoe.analysis.dynamic_bench import DynamicBenchResult
from tiermoe.analysis.placement_result import PlacementBenchResult
from tiermoe.analysis.trace_replay import ORACLES
from tiermoe.placement.plan import PlacementPlan

_CPU_CELL = "#e8e8e8"  # a plan without statistics: CPU-tier cells light grey, GPU-tier cells in their rank's colour
# with statistics: shares in greys from white to mid grey, so that every rank's outline colour stands out on any cell
_SHARE_GREYS = ("#ffffff", "#707070")
_RANK_COLOURS = ("tab:red", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                 "tab:cyan", "black")
_LINE_STYLES = ("-", "--", "-.", ":")  # dashes keep coinciding lines visible
# one marker per line, the first ones largest: lines that coincide (strategies that pick the same experts) still
# show every marker around the one drawn over it
_MARKERS = (("o", 9), ("s", 8), ("^", 7.5), ("D", 6.5), ("v", 5.5), ("P", 5), ("X", 4), ("*", 6), ("h", 3.5),
            ("<", 3.5))
_LOG_SPAN = 10.0  # a value axis whose data spans more than this factor is drawn on a log scale
_PERCENT = (-2, 102)  # a hit rate's whole scale, with room for the markers at 0% and 100%


def _pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return Path(path)


def _legend_below(fig, ax_or_handles, ncols: int | None = None):
    """One legend for the figure, in the margin under the axes (the constrained layout makes room for it)."""
    if isinstance(ax_or_handles, list):
        handles = ax_or_handles
        labels = [h.get_label() for h in handles]
    else:
        handles, labels = ax_or_handles.get_legend_handles_labels()
    return fig.legend(handles, labels, loc="outside lower center", ncols=ncols or min(len(labels), 5), fontsize=8,
                      frameon=False)


def _marker(i: int) -> dict:
    marker, size = _MARKERS[i % len(_MARKERS)]
    return {"marker": marker, "markersize": size}


def _fit_value_axis(ax, values) -> None:
    """A throughput axis fitted to its data: matplotlib's own limits around the values (not stretched down to 0),
    on a log scale when they span more than _LOG_SPAN (a model that runs 20x faster with every expert on the GPU
    would otherwise flatten every other point)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    positive = [v for v in values if v is not None and v == v and v > 0]
    if positive and max(positive) > _LOG_SPAN * min(positive):
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 100, 200, 500, 1000: plain numbers
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel(f"{ax.get_ylabel()}, log scale")


def plan_figure(plan: PlacementPlan, counts=None, title: str = ""):
    """Heatmap layers x experts. With statistics: colour = share of the layer's routed tokens, GPU-tier experts
    outlined (one colour per GPU rank); without: GPU-tier experts filled, CPU-tier ones grey (no colour bar,
    since there is no quantity to show)."""
    plt = _pyplot()
    from matplotlib.collections import PatchCollection
    from matplotlib.colors import LinearSegmentedColormap, ListedColormap
    from matplotlib.patches import Patch, Rectangle

    width = min(18.0, 4.0 + plan.num_experts * 0.15)
    height = min(14.0, 2.6 + plan.num_layers * 0.3)
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    rank_colour = [_RANK_COLOURS[r % len(_RANK_COLOURS)] for r in range(plan.num_gpus)]
    rank_label = ["GPU tier"] if plan.num_gpus == 1 else [f"GPU {r}" for r in range(plan.num_gpus)]
    handles = []
    if counts is not None:
        counts = torch.as_tensor(counts, dtype=torch.float64)
        share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1e-300)
        greys = LinearSegmentedColormap.from_list("share", _SHARE_GREYS)
        image = ax.imshow(share.numpy(), aspect="auto", cmap=greys, interpolation="nearest")
        fig.colorbar(image, ax=ax, label="share of the layer's routed tokens")
        line = 1.6 if plan.num_experts <= 64 else 0.8
        for rank in range(plan.num_gpus):  # a whole cell outlined: readable at any grid size, unlike a marker
            layers, experts = (plan.assignment == rank).nonzero(as_tuple=True)
            cells = [Rectangle((e - 0.45, layer - 0.45), 0.9, 0.9)
                     for layer, e in zip(layers.tolist(), experts.tolist(), strict=True)]
            ax.add_collection(PatchCollection(cells, facecolor="none", edgecolor=rank_colour[rank], linewidth=line))
            handles.append(Patch(facecolor="none", edgecolor=rank_colour[rank], linewidth=line,
                                 label=f"{rank_label[rank]} (outlined)"))
    else:
        cells = plan.assignment.clamp(min=-1) + 1  # 0 = CPU tier, r + 1 = GPU rank r
        cmap = ListedColormap([_CPU_CELL, *rank_colour])
        ax.imshow(cells.numpy(), aspect="auto", cmap=cmap, vmin=-0.5, vmax=plan.num_gpus + 0.5,
                  interpolation="nearest")
        handles += [Patch(facecolor=rank_colour[r], label=rank_label[r]) for r in range(plan.num_gpus)]
        handles.append(Patch(facecolor=_CPU_CELL, edgecolor="grey", linewidth=0.5, label="CPU tier"))
    if plan.num_experts <= 64 and plan.num_layers <= 64:  # white lines between cells: each expert its own box
        ax.set_xticks([e - 0.5 for e in range(1, plan.num_experts)], minor=True)
        ax.set_yticks([layer - 0.5 for layer in range(1, plan.num_layers)], minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    _integer_ticks(ax)
    ax.set_title(title or f"{plan.strategy}: {int(plan.mask.sum())} experts on the GPU tier"
                 + ("" if counts is not None else " (no statistics)"))
    _legend_below(fig, handles)
    return fig


def plot_plan(plan: PlacementPlan, path: str | Path, counts=None, title: str = "") -> Path:
    """plan_figure saved as a PNG."""
    return _save(plan_figure(plan, counts, title), path)


def _integer_ticks(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def report_figure(r: dict):
    """Left: expected GPU hit rate of each strategy at GPU ratios 10%..90%. Right: per-layer Gini and top-20%
    share. One legend each, under its own axes."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig = plt.figure(figsize=(12, 5.2), layout="constrained")
    left_fig, right_fig = fig.subfigures(1, 2)
    left, right = left_fig.subplots(), right_fig.subplots()
    hits = r["hit_rates"]
    ratios = [100 * x for x in hits["ratios"]]
    for i, (name, rates) in enumerate(hits["strategies"].items()):
        left.plot(ratios, [100 * v for v in rates], linestyle=_LINE_STYLES[i % 4], label=name, **_marker(i))
    left.plot(ratios, ratios, color="grey", linewidth=0.8, label="no skew (hit = share)")
    left.set_xlabel("routed experts on the GPU tier (%)")
    left.set_ylabel("expected GPU hit rate (%)")
    left.set_ylim(*_PERCENT)  # a hit rate's whole scale: how far from 100% matters
    left.set_title("placement strategies" + (" (in-sample)" if isinstance(hits["evaluated_on"], str) else
                                             " (held-out evaluation)"))
    left.grid(alpha=0.3)
    _legend_below(left_fig, left, ncols=3)
    layers = [row["layer"] for row in r["layers"]]
    right.bar(layers, [row["gini"] for row in r["layers"]], color="tab:blue", label="Gini")
    right.plot(layers, [row["top20_share"] for row in r["layers"]], color="tab:orange", marker=".",
               label="top-20% experts' share")
    right.set_xlabel("layer")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_ylim(0, 1.02)  # both are shares (bars from 0; room for a marker at 1)
    right.set_title("routing skew per MoE layer")
    right.grid(alpha=0.3)
    _legend_below(right_fig, right, ncols=2)
    fig.suptitle(", ".join(Path(s).name for s in r["sources"]), fontsize=9)
    return fig


def plot_report(r: dict, path: str | Path) -> Path:
    """report_figure saved as a PNG."""
    return _save(report_figure(r), path)


def dynamic_bench_figure(bench: DynamicBenchResult, title: str):
    """Hit rate and estimated output tokens/s against the GPU ratio, one line per policy (oracles dotted)."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5), layout="constrained")
    all_tokens = []
    for i, policy in enumerate(bench.policies):
        style = ":" if policy in ORACLES else "-"
        ys = [bench.get(policy, r) for r in bench.ratios]
        tokens = [float("nan") if y["estimated_output_tokens_per_s"] is None else y["estimated_output_tokens_per_s"]
                  for y in ys]  # no estimate: a gap, not a point at 0
        all_tokens += tokens
        ax1.plot(bench.ratios, [100 * y["hit_rate"] for y in ys], style, label=policy, **_marker(i))
        ax2.plot(bench.ratios, tokens, style, label=policy, **_marker(i))
    ax1.set(xlabel="GPU expert ratio", ylabel="GPU hit rate (%)", title="hit rate (measured on the trace)",
            ylim=_PERCENT)
    ax2.set(xlabel="GPU expert ratio", ylabel="output tokens/s (estimate)", title="throughput (cost-model estimate)")
    _fit_value_axis(ax2, all_tokens)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    _legend_below(fig, ax1, ncols=min(len(bench.policies), 8))
    fig.suptitle(title)
    return fig


def plot_bench(bench: DynamicBenchResult, path: str, title: str) -> None:
    """dynamic_bench_figure saved as a PNG."""
    _save(dynamic_bench_figure(bench, title), path)


def placement_bench_figure(result: PlacementBenchResult):
    """Output tokens/s against the GPU ratio per strategy (the axis fitted to the data), and hit rate beside it."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5), layout="constrained")
    xs = [100 * r for r in result.ratios]
    all_tokens = []
    for i, strategy in enumerate(result.strategies):
        cells = [result.get(strategy, r) for r in result.ratios]
        style = "--" if strategy in ("dynamic", "adaptive") else "-"
        tokens = [c.output_tokens_per_s for c in cells]
        all_tokens += tokens
        ax1.plot(xs, tokens, style, label=strategy, **_marker(i))
        ax2.plot(xs, [100 * c.hit_rate for c in cells], style, label=strategy, **_marker(i))
    estimate = " (ESTIMATE)" if result.estimated else " (measured)"
    ax1.set(xlabel="GPU expert ratio (%)", ylabel="output tokens/s" + estimate, title="throughput" + estimate)
    _fit_value_axis(ax1, all_tokens)
    ax2.set(xlabel="GPU expert ratio (%)", ylabel="GPU-tier hit rate (%)", title="GPU-tier hit rate (exact)",
            ylim=_PERCENT)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    _legend_below(fig, ax1, ncols=min(len(result.strategies), 8))
    setup = result.setup
    fig.suptitle(f"tiermoe bench placement: {setup.get('model_name', '?')}, {setup.get('dataset', '?')}, "
                 f"GPU profile {result.gpu_profile.get('name', '?')}" + (" - throughput is a cost-model ESTIMATE"
                                                                          if result.estimated else ""))
    return fig


def plot_placement_bench(result: PlacementBenchResult, path: str) -> None:
    """placement_bench_figure saved as a PNG."""
    _save(placement_bench_figure(result), path)


def loss_curve_figure(history: list[dict], evals: list[dict], title: str = ""):
    """Training loss per step (faint) with its moving average, and the held-out loss where it was measured."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
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
    if ax.get_legend_handles_labels()[1]:
        _legend_below(fig, ax)
    return fig


def plot_loss_curve(history: list[dict], evals: list[dict], path: str | Path, title: str = "") -> Path:
    """loss_curve_figure saved as a PNG."""
    return _save(loss_curve_figure(history, evals, title), path)
