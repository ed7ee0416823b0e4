"""tiermoe stats's flags: summarise activation statistics files and what each placement strategy would get from
them (run: stats_run)."""

from __future__ import annotations

from tiermoe.cli.flags import add_command, plot_file, seed_int


def add_parser(sub) -> None:
    p = add_command(
        sub, "stats",
        "Summarise expert activation statistics (tiermoe record output, SGLang's expert_distribution_recorder_*.pt, "
        "KTransformers' activation_stats.pt; several files are merged): per-layer Gini, share of routed tokens "
        "served by the busiest tenth and fifth of the experts, dead experts, prefill vs decode, and the expected GPU "
        "hit rate of every placement strategy with 0.1 to 0.9 of the routed experts on the GPU tier.",
        "tiermoe stats stats.pt",
        "tiermoe stats stats.pt --json",
        "tiermoe stats train.pt --eval heldout.pt --plot hit_rates.png",
        "tiermoe stats expert_distribution_recorder_1730000000.pt activation_stats.pt",
        "tiermoe stats run.pt --plan plan.json",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="statistics file(s) (.pt); several are summed")
    p.add_argument("--eval", nargs="+", metavar="FILE",
                   help="measure the hit rates on these statistics instead (e.g. a held-out split)")
    p.add_argument("--plan", help="check the file's GPU-tier snapshots against this plan.json")
    p.add_argument("--placement-seed", type=seed_int, default=42, help="seed of the random strategy")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", type=plot_file,
                   help="draw hit rate vs GPU ratio per strategy and per-layer skew to this PNG")
