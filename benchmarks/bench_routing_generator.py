"""The routing generator's statistics next to the real files' (issue 23): Gini by layer, cross-task hit and hot-set
overlap, same-task and per-request hit, reuse by lag against a within-request shuffle, cross-layer reuse
correlation. Files and generated traces are measured by the same code (tiermoe.routing.statistics).

- ESFT (DeepSeek-V2-Lite layout, 26 x 64, top-6; tasks intent, law, summary): the generator runs with the files'
  shape and request lengths, one task per file, and is measured exactly as the files are.
- Qwen3-30B-A3B decode heat (48 x 128, top-8, 75,773 tokens of 200 prompts): Gini by layer of the heat next to
  the generator's over as many tokens (200 requests of 379 tokens), and a uniform router's at that sample.

    PYTHONPATH=$PWD python benchmarks/bench_routing_generator.py --data data/routing \
        --out benchmarks/results/routing_generator.json --markdown benchmarks/results/routing_generator.md \
        --plot benchmarks/results/routing_generator.png

`--refit` fits the parameters again (minutes; prints them in the form of tiermoe/routing/presets.py)
instead of using the presets.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from tiermoe.routing.fit import fit_routing, fit_skew_to_heat, request_lengths, simulate, targets_from_traces
from tiermoe.routing.generator import RoutingParams
from tiermoe.routing.measures import gini_by_layer
from tiermoe.routing.presets import PRESETS
from tiermoe.routing.sources import load_task_traces
from tiermoe.routing.statistics import RoutingStatistics, measure_routing
from tiermoe.routing.balance import gini
from tiermoe.routing.trace_convert import read_routing

QWEN_REQUESTS = 200


def span(values) -> str:
    values = list(values)
    return f"{np.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def summary_rows(files: RoutingStatistics, gen: RoutingStatistics) -> list[tuple[str, str, str]]:
    rows = []
    for label, fn in (
        ("Gini, mean of layers and tasks (same tokens per task)", lambda s: f"{s.gini_M.mean():.3f}"),
        ("Gini, first MoE layer", lambda s: f"{s.gini_M[0]:.3f}"),
        ("Gini, mean of the first / last third of layers",
         lambda s: f"{s.gini_M[:len(s.gini_M) // 3].mean():.3f} / {s.gini_M[-(len(s.gini_M) // 3):].mean():.3f}"),
        ("Gini per task, mean of layers", lambda s: " / ".join(f"{t.gini_M.mean():.3f}" for t in s.tasks)),
        (f"cross-task hit, hot set of {files.hot} (6 ordered pairs)", lambda s: span(s.cross_hit.values())),
        ("hot-set overlap between tasks (3 pairs)", lambda s: span(s.overlap.values())),
        ("same-task hit (even requests -> odd)", lambda s: span(t.same_task_hit for t in s.tasks)),
        ("per-request oracle hit (in-sample)", lambda s: span(t.request_oracle_hit for t in s.tasks)),
        ("lag-1 reuse", lambda s: span(t.lag_D[0] for t in s.tasks)),
        ("lag-1 reuse, requests shuffled", lambda s: span(t.shuffled_D[0] for t in s.tasks)),
        ("reuse of two random tokens of the task", lambda s: span(t.task_shuffled for t in s.tasks)),
        ("excess reuse at lag 1 / 2 / 4 / 8",
         lambda s: " / ".join(f"{s.mean('excess_D')[d - 1]:.3f}" for d in (1, 2, 4, 8))),
        ("cross-layer correlation of lag-1 reuse", lambda s: span(t.layer_reuse_correlation for t in s.tasks)),
        ("cross-layer dependence of a token's experts (TV)", lambda s: span(t.layer_dependence for t in s.tasks)),
        ("  the same, layer m+1 from a shuffled token (floor)",
         lambda s: span(t.layer_dependence_shuffled for t in s.tasks)),
    ):
        rows.append((label, fn(files), fn(gen)))
    return rows


def lag_table(files: RoutingStatistics, gen: RoutingStatistics) -> list[str]:
    lines = ["| lag | files reuse | generated reuse | files shuffled | generated shuffled | files excess | "
             "generated excess |", "|---|---|---|---|---|---|---|"]
    for d in range(len(files.tasks[0].lag_D)):
        f_lag, g_lag = files.mean("lag_D")[d], gen.mean("lag_D")[d]
        f_sh, g_sh = files.mean("shuffled_D")[d], gen.mean("shuffled_D")[d]
        lines.append(f"| {d + 1} | {f_lag:.3f} | {g_lag:.3f} | {f_sh:.3f} | {g_sh:.3f} | {f_lag - f_sh:.3f} | "
                     f"{g_lag - g_sh:.3f} |")
    return lines


def qwen_heat(data: Path, params: RoutingParams, refit: bool, seed: int) -> dict:
    heat = read_routing(data / "qwen3-moe-heat" / "heat_qwen3-30b-a3b.csv", "heat")
    counts = heat["logical_count"].sum(0).double()
    layers = heat.get("moe_layers") or list(range(counts.shape[0]))
    heat_ME = counts[layers]
    preset = PRESETS["qwen3-30b-a3b"]
    if refit:
        params, _ = fit_skew_to_heat(params, heat_ME, preset.shape.top_k, QWEN_REQUESTS, seed=seed)
    tokens = int(round(float(heat_ME.sum(1).mean()) / preset.shape.top_k))
    lengths = ((tokens // QWEN_REQUESTS,) * QWEN_REQUESTS,)
    generated = simulate(params, preset.shape, lengths, seed)[0]
    uniform = RoutingParams((0.0,), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    flat = simulate(uniform, preset.shape, lengths, seed)[0]
    return {"params": params, "tokens": tokens, "heat_M": np.array([gini(r) for r in heat_ME]),
            "generated_M": gini_by_layer(generated), "uniform_M": gini_by_layer(flat)}


def plot(files: RoutingStatistics, gen: RoutingStatistics, qwen: dict | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    for t, g in zip(files.tasks, gen.tasks):
        line, = ax.plot(range(1, len(t.gini_M) + 1), t.gini_M, "-", label=f"{t.name} file", alpha=0.8)
        ax.plot(range(1, len(g.gini_M) + 1), g.gini_M, "--", color=line.get_color(), label=f"{g.name} generated")
    ax.set_title(f"ESFT DeepSeek-V2-Lite: Gini by MoE layer ({files.gini_tokens} tokens per task)")
    ax.set_xlabel("MoE layer")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[0][1]
    if qwen:
        x = range(len(qwen["heat_M"]))
        ax.plot(x, qwen["heat_M"], "-", label="Qwen3-30B-A3B heat")
        ax.plot(x, qwen["generated_M"], "--", label="generated (qwen3-30b-a3b)")
        ax.plot(x, qwen["uniform_M"], ":", label="uniform router")
        ax.set_title(f"Qwen3-30B-A3B: Gini by layer ({qwen['tokens']:,} tokens)")
        ax.set_xlabel("layer")
        ax.legend(fontsize=8)
    ax = axes[1][0]
    lags = np.arange(1, len(files.tasks[0].lag_D) + 1)
    ax.plot(lags, files.mean("lag_D"), "o-", label="files")
    ax.plot(lags, gen.mean("lag_D"), "o--", label="generated")
    ax.plot(lags, files.mean("shuffled_D"), "s-", alpha=0.6, label="files, requests shuffled")
    ax.plot(lags, gen.mean("shuffled_D"), "s--", alpha=0.6, label="generated, requests shuffled")
    ax.set_title("reuse |S_t ∩ S_t-d| / k by lag d (mean of the tasks)")
    ax.set_xlabel("lag")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    pairs = list(files.cross_hit)
    x = np.arange(len(pairs))
    ax.bar(x - 0.2, [files.cross_hit[p] for p in pairs], 0.4, label="files")
    ax.bar(x + 0.2, [gen.cross_hit[p] for p in pairs], 0.4, label="generated")
    ax.axhline(files.hot / 64, color="grey", linestyle=":", label="random hot set")
    ax.set_xticks(x, [f"{a}->{b}" for a, b in pairs], fontsize=8)
    ax.set_title(f"cross-task hit: hot set ({files.hot}/layer) of one task serving another")
    ax.legend(fontsize=8)
    for a in axes.flat:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def preset_literal(params: RoutingParams) -> str:
    skew = ", ".join(f"{x:.3f}" for x in params.skew_by_depth)
    return (f"RoutingParams(skew_by_depth=({skew}), shared={params.shared:.3f}, "
            f"request_spread={params.request_spread:.3f}, fast_spread={params.fast_spread:.3f}, "
            f"fast_keep={params.fast_keep:.3f}, slow_spread={params.slow_spread:.3f}, "
            f"slow_keep={params.slow_keep:.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="data/routing (its esft-deepseek-v2-lite and qwen3-moe-heat)")
    ap.add_argument("--refit", action="store_true", help="fit the parameters again instead of using the presets")
    ap.add_argument("--seed", type=int, default=1, help="seed of the generated traces (the fit uses seed 0)")
    ap.add_argument("--no-qwen", action="store_true", help="skip the Qwen3 heat comparison")
    ap.add_argument("--out")
    ap.add_argument("--markdown")
    ap.add_argument("--plot")
    args = ap.parse_args()
    start = time.time()
    data = Path(args.data)
    traces = load_task_traces([data / "esft-deepseek-v2-lite"])
    files = measure_routing(traces)
    params = PRESETS["esft-deepseek-v2-lite"].params
    if args.refit:
        params = fit_routing(targets_from_traces(traces), progress=lambda s: print(s, flush=True))
        print(f"ESFT = {preset_literal(params)}", flush=True)
    shape = PRESETS["esft-deepseek-v2-lite"].shape
    generated = simulate(params, shape, [request_lengths(t) for t in traces.values()], args.seed)
    gen = measure_routing(dict(zip(traces, generated)))
    qwen = None
    if not args.no_qwen:
        qwen = qwen_heat(data, replace(PRESETS["qwen3-30b-a3b"].params, **{
            k: getattr(params, k) for k in ("shared", "request_spread", "fast_spread", "fast_keep", "slow_spread",
                                            "slow_keep")}) if args.refit else PRESETS["qwen3-30b-a3b"].params,
            args.refit, args.seed)
        if args.refit:
            print(f"QWEN3_SKEW = ({', '.join(f'{x:.3f}' for x in qwen['params'].skew_by_depth)})", flush=True)
    lines = [f"ESFT DeepSeek-V2-Lite traces vs generated (same shape and request lengths, seed {args.seed})", "",
             "| statistic | files | generated |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in summary_rows(files, gen)]
    lines += ["", "Reuse by lag (mean of the tasks)", ""] + lag_table(files, gen)
    lines += ["", "Gini by layer (ESFT: mean of the tasks at the same tokens; Qwen3: the heat's tokens)", "",
              "| MoE layer | ESFT files | ESFT generated |" + (" Qwen3 heat | Qwen3 generated | uniform router |"
                                                             if qwen else ""),
              "|---|---|---|" + ("---|---|---|" if qwen else "")]
    for i in range(max(len(files.gini_M), len(qwen["heat_M"]) if qwen else 0)):
        esft = (f"{files.gini_M[i]:.3f} | {gen.gini_M[i]:.3f}" if i < len(files.gini_M) else " | ")
        tail = (f" {qwen['heat_M'][i]:.3f} | {qwen['generated_M'][i]:.3f} | {qwen['uniform_M'][i]:.3f} |"
                if qwen else "")
        lines.append(f"| {i} | {esft} |{tail}")
    if qwen:
        lines.append(f"| mean | {files.gini_M.mean():.3f} | {gen.gini_M.mean():.3f} | {qwen['heat_M'].mean():.3f} | "
                     f"{qwen['generated_M'].mean():.3f} | {qwen['uniform_M'].mean():.3f} |")
    lines.append(f"\n{time.time() - start:.0f} s")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "seed": args.seed, "params": asdict(params),
            "files": _stats_json(files), "generated": _stats_json(gen),
            "qwen": {k: (v.tolist() if isinstance(v, np.ndarray) else asdict(v) if k == "params" else v)
                     for k, v in qwen.items()} if qwen else None}, indent=1))
    if args.plot:
        plot(files, gen, qwen, args.plot)


def _stats_json(stats: RoutingStatistics) -> dict:
    return {"hot": stats.hot, "gini_tokens": stats.gini_tokens,
            "cross_hit": {f"{a}->{b}": v for (a, b), v in stats.cross_hit.items()},
            "overlap": {f"{a}~{b}": v for (a, b), v in stats.overlap.items()},
            "tasks": [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in asdict(t).items()}
                      for t in stats.tasks]}


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
