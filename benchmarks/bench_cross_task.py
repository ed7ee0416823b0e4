"""Cross-task placement on real routing: calibrate on one task, replay another (issue 23).

The three ESFT traces of a DeepSeek-V2-Lite-layout model (intent, law, summary; 26 MoE layers x 64 experts,
top-6) are split by request: even-numbered requests calibrate, odd-numbered ones are replayed, one token a step.
For every (calibration task, replayed task) pair, GPU ratio and GPU profile, every policy of `tiermoe bench
dynamic` is replayed (static strategies, KT dynamic, LRU / LFU caches, adaptive, and the ceilings: Belady with the
same copy budget, the trace's own static top-k, the per-window oracle), costed with DeepSeek-V2-Lite's experts
(bf16, from its config.json alone). Same-task pairs calibrate on the other half of the same task.

    PYTHONPATH=$PWD python benchmarks/bench_cross_task.py --data ../shared/routing-data/esft-deepseek-v2-lite \
        --out benchmarks/results/cross_task.json --markdown benchmarks/results/cross_task.md \
        --plot benchmarks/results/cross_task.png

Hit rates are measured on the trace; tokens/s are cost-model ESTIMATES (copies charged in full).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from tiermoe.analysis.dynamic_bench import DEFAULT_RATIOS, replay_cost_model, run_dynamic_bench
from tiermoe.analysis.trace_replay import trace_passes
from tiermoe.arch import detect, load_config
from tiermoe.placement.profiles import load_profile
from tiermoe.stats.trace_convert import read_routing
from tiermoe.stats.traces import counts_from_trace
from tiermoe.testing.presets import make_config

TASKS = ("intent", "law", "summary")
PROFILES = ("rtx4090", "h200")
STATIC = ("uniform", "front-loading", "random", "frequency", "balanced")
BASELINES = STATIC + ("kt-dynamic", "lru", "lfu")
CEILINGS = ("belady", "oracle-static", "oracle-window")


def select_tokens(trace: dict, keep_N: torch.Tensor) -> dict:
    """The trace restricted to the tokens where keep_N is True (passes renumbered, counts recomputed)."""
    out = dict(trace)
    for key in ("token_pass", "token_request", "token_position", "token_is_prefill", "topk_ids"):
        out[key] = trace[key][keep_N]
    out["token_pass"] = torch.unique(out["token_pass"], return_inverse=True)[1].to(torch.int32)
    out["logical_count"] = counts_from_trace(out, trace["num_layers"], trace["num_experts"])[None]
    return out


def halves(trace: dict) -> tuple[dict, dict]:
    odd = trace["token_request"] % 2 == 1
    return select_tokens(trace, ~odd), select_tokens(trace, odd)


def run_pair(job) -> list[dict]:
    data, calib_task, replay_task, profile, config_dir, ratios, copy_budget = job
    torch.set_num_threads(1)
    calib, _ = halves(read_routing(Path(data) / f"trace_{calib_task}.txt", "esft-trace"))
    _, held_out = halves(read_routing(Path(data) / f"trace_{replay_task}.txt", "esft-trace"))
    spec = detect(load_config(config_dir))
    cost = replay_cost_model(spec, load_profile(profile))
    calibration = counts_from_trace(calib, calib["num_layers"], calib["num_experts"]).double()
    bench = run_dynamic_bench(trace_passes(held_out), cost, ratios, calibration, copy_budget=copy_budget)
    return [dict(row, calibration=calib_task, replayed=replay_task, gpu_profile=profile) for row in bench.rows]


def summarise(rows: list[dict], ratios, profile: str, pairs: str) -> str:
    """Mean over the chosen pairs of hit rate and tokens/s per policy and ratio, and where adaptive loses."""
    chosen = [r for r in rows if r["gpu_profile"] == profile and
              ((r["calibration"] != r["replayed"]) if pairs == "cross" else (r["calibration"] == r["replayed"]))]
    policies = list(dict.fromkeys(r["policy"] for r in chosen))
    lines = []
    for field, fmt, title in (("hit_rate", "{:.1%}", "hit rate"),
                              ("estimated_output_tokens_per_s", "{:.2f}", "tokens/s (ESTIMATE)")):
        lines += [f"\n{profile}, {title}, mean of the {'cross-task' if pairs == 'cross' else 'same-task'} pairs\n",
                  "| ratio | " + " | ".join(policies) + " |", "|---" * (len(policies) + 1) + "|"]
        for ratio in ratios:
            cells = []
            for p in policies:
                vals = [r[field] for r in chosen if r["policy"] == p and abs(r["gpu_ratio"] - ratio) < 1e-9]
                cells.append(fmt.format(sum(vals) / len(vals)))
            lines.append(f"| {ratio:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def losses(rows: list[dict], field: str) -> list[str]:
    """Every (profile, pair, ratio) where adaptive is below a baseline, or more than 10 points below the
    per-window oracle (hit rate, ratios 0.1-0.4)."""
    out = []
    cells = {}
    for r in rows:
        cells.setdefault((r["gpu_profile"], r["calibration"], r["replayed"], r["gpu_ratio"]), {})[r["policy"]] = r
    for (profile, calib, replay, ratio), by in sorted(cells.items()):
        a = by["adaptive"][field]
        beaten = [p for p in BASELINES if p in by and by[p][field] > a + 1e-9]
        if beaten:
            out.append(f"{profile} {calib}->{replay} {ratio:.1f}: " + ", ".join(
                f"{p} {by[p][field]:.3g}" for p in beaten) + f" > adaptive {a:.3g}")
    return out


def plot(rows: list[dict], ratios, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for col, profile in enumerate(PROFILES):
        for row, (field, label) in enumerate((("hit_rate", "GPU hit rate"),
                                              ("estimated_output_tokens_per_s", "tokens/s (estimate)"))):
            ax = axes[row][col]
            cross = [r for r in rows if r["gpu_profile"] == profile and r["calibration"] != r["replayed"]]
            for policy in dict.fromkeys(r["policy"] for r in cross):
                ys = [sum(r[field] for r in cross if r["policy"] == policy and abs(r["gpu_ratio"] - x) < 1e-9) / 6
                      for x in ratios]
                style = "--" if policy in CEILINGS else ("-" if policy == "adaptive" else ":")
                ax.plot(ratios, ys, style, marker="o", markersize=3, label=policy,
                        linewidth=2.5 if policy == "adaptive" else 1.2)
            ax.set_title(f"{profile}: {label}, mean of the 6 cross-task pairs")
            ax.set_xlabel("GPU expert ratio")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("ESFT DeepSeek-V2-Lite traces: calibrate on one task, replay another (odd requests, 1 token/step)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="the esft-deepseek-v2-lite folder (trace_<task>.txt)")
    ap.add_argument("--ratios", default=",".join(str(r) for r in DEFAULT_RATIOS))
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--copy-budget", type=int, default=4, help="swaps per step for lru / lfu / belady (default 4)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--markdown")
    ap.add_argument("--plot")
    args = ap.parse_args()
    ratios = [float(x) for x in args.ratios.split(",")]
    config_dir = tempfile.mkdtemp(prefix="dsv2lite-")
    make_config("deepseek_v2", "deepseek-v2-lite").to_json_file(Path(config_dir) / "config.json")
    jobs = [(args.data, a, b, p, config_dir, ratios, args.copy_budget)
            for p in args.profiles.split(",") for a in TASKS for b in TASKS]
    start = time.time()
    rows: list[dict] = []
    with ProcessPoolExecutor(args.workers) as pool:
        for done in pool.map(run_pair, jobs):
            rows += done
            print(f"{len(rows)} rows, {time.time() - start:.0f} s", flush=True)
    Path(args.out).write_text(json.dumps({"copy_budget": args.copy_budget, "ratios": ratios, "rows": rows}))
    text = "\n".join(summarise(rows, ratios, p, pairs) for p in args.profiles.split(",")
                     for pairs in ("cross", "same"))
    lost = losses(rows, "hit_rate")
    cells = len({(r["gpu_profile"], r["calibration"], r["replayed"], r["gpu_ratio"]) for r in rows})
    text += f"\n\nadaptive below a baseline in hit rate: {len(lost)} of {cells} cells\n" + "\n".join(
        f"- {x}" for x in lost[:60])
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.plot:
        plot(rows, ratios, args.plot)


if __name__ == "__main__":
    main()
