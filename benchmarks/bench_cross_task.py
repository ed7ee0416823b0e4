"""Cross-task placement on real routing: calibrate on one task, replay another (issue 23).

The three ESFT traces of a DeepSeek-V2-Lite-layout model (intent, law, summary; 26 MoE layers x 64 experts,
top-6) are split by request: even-numbered requests calibrate, odd-numbered ones are replayed, one token a step.
For every (calibration task, replayed task) pair, GPU ratio and GPU profile, every policy of `tiermoe bench
dynamic` is replayed (static strategies, KT dynamic, LRU / LFU caches, adaptive, and the ceilings: Belady with the
same copy budget, the trace's own static top-k, the per-request and per-window oracles), costed with
DeepSeek-V2-Lite's experts (bf16, from its config.json alone). Same-task pairs calibrate on the other half of the
same task.

    PYTHONPATH=$PWD python benchmarks/bench_cross_task.py --data data/routing/esft-deepseek-v2-lite \
        --out benchmarks/results/cross_task.json --markdown benchmarks/results/cross_task.md \
        --plot benchmarks/results/cross_task.png

Hit rates are measured on the trace; tokens/s are cost-model ESTIMATES (copies charged in full). `--from-json
FILE` summarises and plots an earlier run's rows without replaying (benchmarks/placement_verdict.py judges each
cell).

Prefill: the ESFT traces are teacher-forced prompt + answer in prefill order, with no mark where the prompt ends.
`--prompt-share 0.5` makes the first half of every replayed request (rounded up) its prompt, one prefill pass,
and the rest its answer, one token a step (0, the default: every token a step). Variants of the adaptive policy
are replayed beside it as `adaptive[NAME]` rows (AdaptiveSettings fields):

    PYTHONPATH=$PWD python benchmarks/bench_cross_task.py --data data/routing/esft-deepseek-v2-lite \
        --profiles rtx4090 --ratios 0.1,0.3 --pairs law:intent --prompt-share 0.5 \
        --policies frequency,lfu,adaptive --adaptive-variant before:cross_layer=0,swap_z_score=0 \
        --adaptive-variant prompt:prompt_evidence=1 --out scratch/x.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from tiermoe.analysis.dynamic_bench import (
    DEFAULT_RATIOS,
    replay_cost_model,
    run_dynamic_bench,
)
from tiermoe.analysis.trace_replay import REPLAY_POLICIES, replay, trace_passes
from tiermoe.arch import detect, load_config
from tiermoe.placement.adaptive_policy import AdaptiveSettings
from tiermoe.placement.profiles import load_profile
from tiermoe.routing.trace_convert import read_routing
from tiermoe.stats.trace_csv import one_request_passes
from tiermoe.stats.traces import counts_from_trace
from tiermoe.testing.presets import make_config

TASKS = ("intent", "law", "summary")
PROFILES = ("rtx4090", "h200")
STATIC = ("uniform", "front-loading", "random", "frequency", "balanced")
BASELINES = STATIC + ("kt-dynamic", "lru", "lfu")
CEILINGS = ("belady", "oracle-static", "oracle-request", "oracle-window")


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


def with_prompts(trace: dict, share: float) -> dict:
    """The trace with the first ceil(share x length) tokens of every request marked prompt: one prefill pass per
    request, then its other tokens one a step (requests one at a time, in order)."""
    if share <= 0:
        return trace
    seq, pos = trace["token_request"].long(), trace["token_position"].long()
    length = torch.zeros(int(seq.max()) + 1, dtype=torch.long).scatter_reduce(0, seq, pos + 1, "amax")
    prompt = pos < torch.ceil(share * length[seq].double()).long()
    return dict(trace, token_is_prefill=prompt, token_pass=one_request_passes(seq, prompt).to(torch.int32))


def parse_variant(text: str) -> tuple[str, dict]:
    """'NAME:field=value,...' -> (NAME, {field: value}) for AdaptiveSettings (bools as 0/1)."""
    name, _, spec = text.partition(":")
    types = {f.name: f.type for f in dataclasses.fields(AdaptiveSettings)}
    fields = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"--adaptive-variant: '{key}' is no AdaptiveSettings field ({', '.join(types)})")
        fields[key] = bool(int(value)) if "bool" in str(types[key]) else float(value)
    return name, fields


def variant_rows(passes, cost, ratios, calibration, copy_budget: int, variants) -> list[dict]:
    """Adaptive replayed with each variant's AdaptiveSettings fields (parse_variant), as rows 'adaptive[NAME]'."""
    rows = []
    for name, fields in variants:
        settings = AdaptiveSettings(**dict({"max_swaps_in_flight": copy_budget}, **fields))
        rows += [dict(replay(passes, "adaptive", ratio, cost, calibration, adaptive=settings,
                             copy_budget=copy_budget).summary(), policy=f"adaptive[{name}]") for ratio in ratios]
    return rows


def run_pair(job) -> list[dict]:
    data, calib_task, replay_task, profile, config_dir, ratios, copy_budget, policies, variants, share = job
    torch.set_num_threads(1)
    calib, _ = halves(read_routing(Path(data) / f"trace_{calib_task}.txt", "esft-trace"))
    _, held_out = halves(read_routing(Path(data) / f"trace_{replay_task}.txt", "esft-trace"))
    spec = detect(load_config(config_dir))
    cost = replay_cost_model(spec, load_profile(profile))
    calibration = counts_from_trace(calib, calib["num_layers"], calib["num_experts"]).double()
    passes = trace_passes(with_prompts(held_out, share))
    bench = run_dynamic_bench(passes, cost, ratios, calibration, copy_budget=copy_budget, policies=policies)
    rows = bench.rows + variant_rows(passes, cost, ratios, calibration, copy_budget, variants)
    return [dict(row, calibration=calib_task, replayed=replay_task, gpu_profile=profile, prompt_share=share)
            for row in rows]


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
    for (profile, calib, replayed, ratio), by in sorted(cells.items()):
        if "adaptive" not in by:
            continue
        a = by["adaptive"][field]
        beaten = [p for p in BASELINES if p in by and by[p][field] > a + 1e-9]
        if beaten:
            out.append(f"{profile} {calib}->{replayed} {ratio:.1f}: " + ", ".join(
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
                ys = [sum(v) / max(1, len(v)) for v in
                      ([r[field] for r in cross if r["policy"] == policy and abs(r["gpu_ratio"] - x) < 1e-9]
                       for x in ratios)]
                style = "--" if policy in CEILINGS else ("-" if policy == "adaptive" else ":")
                ax.plot(ratios, ys, style, marker="o", markersize=3, label=policy,
                        linewidth=2.5 if policy == "adaptive" else 1.2)
            ax.set_title(f"{profile}: {label}, mean of the cross-task pairs")
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
    ap.add_argument("--copy-budget", type=int, default=4,
                    help="swaps under way at once for lru / lfu / belady and adaptive (default 4)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pairs", help="calibration:replayed task pairs, e.g. law:intent,intent:intent (default: all 9)")
    ap.add_argument("--policies", default=",".join(REPLAY_POLICIES), help="replayed policies (default: all)")
    ap.add_argument("--adaptive-variant", action="append", default=[], metavar="NAME:FIELD=V,...",
                    help="also replay adaptive with these AdaptiveSettings, as rows 'adaptive[NAME]' (repeatable)")
    ap.add_argument("--prompt-share", type=float, default=0.0,
                    help="share of each replayed request that is its prompt, one prefill pass (default 0)")
    ap.add_argument("--from-json", metavar="FILE", help="no replay: summarise and plot the rows of an earlier --out")
    ap.add_argument("--out")
    ap.add_argument("--markdown")
    ap.add_argument("--plot")
    args = ap.parse_args()
    ratios = [float(x) for x in args.ratios.split(",")]
    if not 0 <= args.prompt_share < 1:
        raise SystemExit("--prompt-share must be in [0, 1)")
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        report(saved["rows"], saved["ratios"], sorted({r["gpu_profile"] for r in saved["rows"]}), args)
        return
    if not args.out:
        raise SystemExit("--out is required (or --from-json)")
    config_dir = tempfile.mkdtemp(prefix="dsv2lite-")
    make_config("deepseek_v2", "deepseek-v2-lite").to_json_file(Path(config_dir) / "config.json")
    every_pair = [(a, b) for a in TASKS for b in TASKS]
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")] if args.pairs else every_pair
    policies = tuple(args.policies.split(","))
    variants = [parse_variant(v) for v in args.adaptive_variant]
    jobs = [(args.data, a, b, p, config_dir, ratios, args.copy_budget, policies, variants, args.prompt_share)
            for p in args.profiles.split(",") for a, b in pairs]
    start = time.time()
    rows: list[dict] = []
    with ProcessPoolExecutor(args.workers) as pool:
        for done in pool.map(run_pair, jobs):
            rows += done
            print(f"{len(rows)} rows, {time.time() - start:.0f} s", flush=True)
    Path(args.out).write_text(json.dumps({"copy_budget": args.copy_budget, "ratios": ratios,
                                          "prompt_share": args.prompt_share, "rows": rows}))
    report(rows, ratios, args.profiles.split(","), args)


def report(rows: list[dict], ratios, profiles, args) -> None:
    text = "\n".join(summarise(rows, ratios, p, pairs) for p in profiles for pairs in ("cross", "same"))
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
