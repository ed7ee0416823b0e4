"""The --plot figures are readable: every legend sits outside the data (its box holds no plotted point and does
not overlap any axes), the throughput axes fit their data instead of starting at 0, a plan without statistics
has no colour bar, and place's table gives bytes in a unit that fits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli

from tiermoe.analysis.dynamic_bench import DynamicBenchResult
from tiermoe.analysis.placement_result import Cell, PlacementBenchResult
from tiermoe.cli.plots import (
    dynamic_bench_figure,
    loss_curve_figure,
    placement_bench_figure,
    plan_figure,
    plot_plan,
    report_figure,
)
from tiermoe.placement.plan import PlacementPlan
from tiermoe.placement.report import format_plan

RATIOS = [0.0, 0.25, 0.5, 0.75, 1.0]
STRATEGIES = ["random", "uniform", "frequency", "adaptive"]


def _all_legends(fig) -> list:
    legends = list(fig.legends)
    for sub in getattr(fig, "subfigs", []):
        legends += _all_legends(sub)
    return legends + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]


def _data_points(ax) -> np.ndarray:
    """Every plotted point of `ax` in display (pixel) coordinates: line vertices, patch corners, image corners."""
    points = []
    for line in ax.get_lines():
        xy = line.get_xydata()
        xy = xy[np.isfinite(xy).all(axis=1)]
        if len(xy):
            points.append(ax.transData.transform(xy))
    for patch in ax.patches:  # bars
        points.append(patch.get_window_extent().get_points())
    for collection in ax.collections:
        for path in collection.get_paths():
            points.append(collection.get_transform().transform(path.vertices))
    for image in ax.images:
        x0, x1, y0, y1 = image.get_extent()
        points.append(ax.transData.transform([(x0, y0), (x1, y1), (x0, y1), (x1, y0)]))
    return np.concatenate(points) if points else np.empty((0, 2))


def assert_legends_clear_of_data(fig) -> None:
    fig.canvas.draw()
    legends = _all_legends(fig)
    assert legends, "the figure has no legend to check"
    data_axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    for legend in legends:
        box = legend.get_window_extent()
        for ax in data_axes:
            points = _data_points(ax)
            x, y = points[:, 0], points[:, 1]
            inside = (x > box.x0) & (x < box.x1) & (y > box.y0) & (y < box.y1)
            assert not inside.any(), f"legend {box} covers {points[inside][:3]} of '{ax.get_title()}'"
            assert not box.overlaps(ax.get_window_extent()), f"legend {box} lies on the axes '{ax.get_title()}'"


def placement_result(tokens_per_s) -> PlacementBenchResult:
    """A bench placement result whose throughput is tokens_per_s(strategy index, ratio)."""
    cells = [Cell(s, r, True, r, 1e6, 0, 0, 1.0, tokens_per_s(i, r), 2 * tokens_per_s(i, r), {"mean": 0.1})
             for i, s in enumerate(STRATEGIES) for r in RATIOS]
    return PlacementBenchResult("estimated", RATIOS, STRATEGIES, cells, {"model_name": "tiny", "dataset": "d"},
                                {"name": "this-cpu"})


@pytest.fixture
def skewed_plan():
    counts = torch.rand(6, 16, generator=torch.Generator().manual_seed(0)) ** 4 * 1000
    mask = torch.zeros(6, 16, dtype=torch.bool)
    mask[:, :3] = True
    return PlacementPlan.from_mask(mask, strategy="frequency"), counts


def test_place_plot_legend_is_outside_the_heatmap_with_and_without_statistics(skewed_plan):
    plan, counts = skewed_plan
    for fig in (plan_figure(plan, counts), plan_figure(plan)):
        assert_legends_clear_of_data(fig)


def test_place_plot_has_a_colour_bar_only_with_statistics(skewed_plan, tmp_path):
    plan, counts = skewed_plan
    assert [ax.get_label() for ax in plan_figure(plan, counts).axes].count("<colorbar>") == 1
    assert [ax.get_label() for ax in plan_figure(plan).axes].count("<colorbar>") == 0
    assert plot_plan(plan, tmp_path / "p.png").stat().st_size > 1000


def test_place_plot_with_several_gpus_labels_each_rank(skewed_plan):
    plan, counts = skewed_plan
    two = PlacementPlan(torch.where(plan.mask, torch.arange(16) % 2, -1), num_gpus=2)
    fig = plan_figure(two, counts)
    assert_legends_clear_of_data(fig)
    labels = [t.get_text() for t in _all_legends(fig)[0].get_texts()]
    assert labels == ["GPU 0 (outlined)", "GPU 1 (outlined)"]


def test_bench_placement_throughput_axis_fits_the_data_and_the_legend_is_outside():
    result = placement_result(lambda i, r: 800 + 50 * i + 400 * (1 - r))  # 800..1350 tokens/s, as on a CPU
    fig = placement_bench_figure(result)
    assert_legends_clear_of_data(fig)
    throughput = fig.axes[0]
    low, high = throughput.get_ylim()
    assert 0 < low <= 800 and high >= 1350  # not forced to 0, every point in view
    assert throughput.get_yscale() == "linear"


def test_bench_placement_throughput_spanning_decades_is_drawn_on_a_log_scale():
    result = placement_result(lambda i, r: 100 * 25 ** r + i)  # 100 .. 2500 tokens/s, as with a fast GPU
    throughput = placement_bench_figure(result).axes[0]
    assert throughput.get_yscale() == "log" and throughput.get_ylim()[0] > 0


def test_bench_dynamic_legend_is_outside_and_throughput_is_not_forced_to_zero():
    rows = [{"policy": p, "gpu_ratio": r, "hit_rate": r, "estimated_output_tokens_per_s": 50 + 10 * r + i}
            for i, p in enumerate(["static", "lru"]) for r in RATIOS]
    fig = dynamic_bench_figure(DynamicBenchResult(RATIOS, ["static", "lru"], rows), "trace")
    assert_legends_clear_of_data(fig)
    assert fig.axes[1].get_ylim()[0] > 0


def test_stats_plot_legends_are_outside_both_panels():
    r = run_cli("stats", str(Path(__file__).parent / "data" / "routing" / "heat_qwen3_slice.csv"), "--json")
    assert r.returncode == 0, r.stderr
    assert_legends_clear_of_data(report_figure(json.loads(r.stdout)))


def test_loss_curve_legend_is_outside():
    history = [{"step": s, "loss": 3 - s / 50} for s in range(1, 60)]
    assert_legends_clear_of_data(loss_curve_figure(history, [{"step": 30, "loss": 2.5}]))


def test_place_table_gives_small_experts_in_kb_not_zero_gb(skewed_plan):
    plan, _ = skewed_plan
    table = format_plan(plan, range(6), None, 589_824)  # the demo model's bf16 expert: 576 KiB
    assert "0.00 GB" not in table
    assert "1.77 MB" in table  # 3 experts a layer
    assert "GPU-tier expert bytes: 10.62 MB" in table
    assert "21.23 GB" in format_plan(plan, range(6), None, 1_179_648_000)
