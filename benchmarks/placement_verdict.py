"""Per cell of a placement replay: is adaptive at or above every baseline, and how far below the oracles? And issue
57's goals, each met or not with its worst cell.

Reads the rows of `benchmarks/bench_cross_task.py --out` or of `tiermoe bench dynamic --json` (several files at
once; a bench dynamic file is labelled by its name and GPU profile) and writes, per (GPU profile, calibration ->
replayed, ratio) cell: adaptive's hit rate and estimated tokens/s, the best baseline in each (every static strategy
present, KT dynamic, LRU, LFU) and by how much adaptive is above or below it, and the hit-rate gaps to the
per-request and per-window oracles at ratios up to 0.4 (the issue's goal: within 10 points). Nothing is replayed:
it reads the rows.

    python benchmarks/placement_verdict.py benchmarks/results/cross_task_full.json \\
        --markdown benchmarks/results/cross_task_full_verdict.md

`--adaptive 'adaptive[NAME]'` judges a variant replayed beside it (bench_cross_task.py --adaptive-variant) instead.

The goals (printed first, one line each: met / NOT MET, the worst cell), per family of rows (the ESFT matrix of
bench_cross_task.py, the synthetic concurrent-task trace of bench_concurrent_tasks.py, the decode traces of
bench_decode_traces.py):
- estimated tokens/s >= every baseline in every cross-task (or trace) cell, ties within 0.05% counted as met;
- same-task cells: the honest-default bound, adaptive's estimated time no more than its starting placement's
  (time-balanced, else frequency) plus the time of the copies it paid (copies at the profile's PCIe rate);
- the mean hit-rate gap to Belady with the same copy budget, cross-task cells at 0.1-0.4, <= 2 points.
A `bench placement --gpu-profile this-cpu --timed-strategies ...` JSON adds: adaptive and time-balanced not below
uniform and frequency at any timed ratio by more than the larger of the two cells' spreads over the rounds, and the
cost model's validation within its tolerance.

    python benchmarks/placement_verdict.py benchmarks/results/cross_task_issue57.json \
        benchmarks/results/concurrent_tasks.json benchmarks/results/decode_*.json \
        benchmarks/results/placement_esft_law_this-cpu.json --markdown benchmarks/results/issue57_verdict.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tiermoe, as PYTHONPATH=$PWD would

from tiermoe.placement.profiles import PRESETS

BASELINES = ("uniform", "front-loading", "random", "frequency", "balanced", "time-balanced", "kt-dynamic", "lru",
             "lfu")
TIE_PERCENT = 0.05  # estimated tokens/s within this of the best baseline counts as at or above it
BELADY_GAP_POINTS = 2.0  # the ceiling goal: mean hit-rate gap to Belady, cross-task cells at 0.1-0.4
# the oracles a gap is reported to: (policy, column label), hindsight and free copies (tiermoe.analysis.trace_replay)
ORACLE_GAPS = (("oracle-request", "per-request oracle"), ("oracle-window", "per-window oracle"))
FIELDS = (("hit_rate", "hit rate", 100.0, "pt"), ("estimated_output_tokens_per_s", "est. tokens/s", None, "%"))


def load_rows(path: str) -> list[dict]:
    data = json.loads(Path(path).read_text())
    if "cells" in data:  # a bench placement result: judged by placement_goals, no replay rows
        return []
    rows = data["rows"]
    if rows and "calibration" not in rows[0]:  # bench dynamic --json: one replay, labelled by the file
        profile = data.get("gpu_profile", {}).get("name", "?")
        name = Path(path).stem.removesuffix(f"_{profile}")  # decode_qwen_h200.json -> decode_qwen
        rows = [dict(r, calibration="-", replayed=name, gpu_profile=profile) for r in rows]
    return rows


def cells(rows: list[dict], judged: str = "adaptive") -> dict:
    """Rows by cell and policy; the `judged` policy's rows stand as "adaptive" (the shipped one's are dropped)."""
    out: dict = {}
    for r in rows:
        policy = r["policy"]
        if policy == "adaptive" and judged != "adaptive":
            continue
        key = (r["gpu_profile"], r["calibration"], r["replayed"], round(r["gpu_ratio"], 6))
        out.setdefault(key, {})["adaptive" if policy == judged else policy] = r
    return out


def verdict(by: dict) -> dict:
    """One cell: per field the best baseline, adaptive's margin over it (points for hit rate, % for tokens/s)."""
    a = by["adaptive"]
    out = {}
    for field, _, scale, _ in FIELDS:
        present = [p for p in BASELINES if p in by]
        best = max(present, key=lambda p: by[p][field])
        value, top = a[field], by[best][field]
        margin = (value - top) * scale if scale else 100.0 * (value / top - 1.0)
        out[field] = {"adaptive": value, "best": best, "best_value": top, "margin": margin,
                      "ok": value >= top - 1e-12}
    out["oracle_gaps"] = {o: 100.0 * (by[o]["hit_rate"] - a["hit_rate"]) for o, _ in ORACLE_GAPS if o in by}
    return out


def _kind(key) -> str:
    """same-task or cross-task pair, or `trace`: one bench dynamic replay (its calibration is its own)."""
    return "trace" if key[1] == "-" else ("same" if key[1] == key[2] else "cross")


def report(rows: list[dict], judged: str = "adaptive") -> str:
    table = cells(rows, judged)
    lines = []
    groups = sorted({(k[0], _kind(k)) for k in table})
    summary = ["| profile | pairs | cells | adaptive >= every baseline: hit rate | est. tokens/s | both | worst hit "
               "margin (pt) | worst tokens/s margin | " + " | ".join(
                   f"{label} gap at 0.1-0.4 (pt) | within 10 pt" for _, label in ORACLE_GAPS) + " |",
               "|---" * (7 + 2 * len(ORACLE_GAPS)) + "|"]
    for profile, kind in groups:
        keys = [k for k in table if k[0] == profile and _kind(k) == kind and "adaptive" in table[k]]
        vs = {k: verdict(table[k]) for k in keys}
        hit = sum(v["hit_rate"]["ok"] for v in vs.values())
        tps = sum(v["estimated_output_tokens_per_s"]["ok"] for v in vs.values())
        both = sum(v["hit_rate"]["ok"] and v["estimated_output_tokens_per_s"]["ok"] for v in vs.values())
        gap_cells = []
        for oracle, _ in ORACLE_GAPS:
            gaps = [v["oracle_gaps"][oracle] for k, v in vs.items()
                    if k[3] <= 0.4 + 1e-9 and oracle in v["oracle_gaps"]]
            span = f"{min(gaps):.1f}-{max(gaps):.1f}" if gaps else "-"
            gap_cells.append(f"{span} | {sum(g <= 10 for g in gaps)} / {len(gaps)}")
        summary.append(f"| {profile} | {kind} | {len(vs)} | {hit} | {tps} | {both} | "
                       f"{min(v['hit_rate']['margin'] for v in vs.values()):+.2f} | "
                       f"{min(v['estimated_output_tokens_per_s']['margin'] for v in vs.values()):+.2f}% | "
                       + " | ".join(gap_cells) + " |")
    lines += summary
    lines += ["", "Per cell: adaptive's hit rate and estimated tokens/s, the best baseline in each and adaptive's "
              "margin "
              "over it (hit rate in points, tokens/s in %; negative = below), and the oracles' hit-rate leads "
              "(points).", "",
              "| profile | calibration -> replayed | ratio | adaptive hit | best baseline (hit) | margin pt | "
              "adaptive tok/s | best baseline (tok/s) | margin | " + " | ".join(
                  f"{label} gap pt" for _, label in ORACLE_GAPS) + " |", "|---" * (9 + len(ORACLE_GAPS)) + "|"]
    for k in sorted(table):
        if "adaptive" not in table[k]:
            continue
        v = verdict(table[k])
        h, t = v["hit_rate"], v["estimated_output_tokens_per_s"]
        lines.append(f"| {k[0]} | {k[1]} -> {k[2]} | {k[3]:.1f} | {100 * h['adaptive']:.2f}% | {h['best']} "
                     f"{100 * h['best_value']:.2f}% | {h['margin']:+.2f} | {t['adaptive']:.2f} | {t['best']} "
                     f"{t['best_value']:.2f} | {t['margin']:+.2f}% | " + " | ".join(
                         f"{v['oracle_gaps'].get(o, float('nan')):.1f}" for o, _ in ORACLE_GAPS) + " |")
    return "\n".join(lines) + "\n"


def family(key) -> str:
    """Which workload a cell is of: the ESFT matrix, the synthetic concurrent-task trace, or a decode trace."""
    if key[1] == "-":
        return "decode traces"
    return "synthetic 8 concurrent tasks" if key[2].startswith("synthetic") else "ESFT matrix"


def _belady_gaps(table: dict, keys: list) -> list[tuple[float, tuple]]:
    return [(100.0 * (table[k]["belady"]["hit_rate"] - table[k]["adaptive"]["hit_rate"]), k) for k in keys
            if "belady" in table[k] and k[3] <= 0.4 + 1e-9]


def _honest_default(by: dict) -> tuple[float, str] | None:
    """Adaptive's time over its start's plus its copies, in % of the start's time (<= 0: within the bound)."""
    start = "time-balanced" if "time-balanced" in by else "frequency"
    if start not in by:
        return None
    a, s = by["adaptive"], by[start]
    pcie = PRESETS[a["gpu_profile"]].pcie_bandwidth if a.get("gpu_profile") in PRESETS else float("inf")
    allowed = s["estimated_seconds"] + a["bytes_copied"] / pcie
    return 100.0 * (a["estimated_seconds"] / allowed - 1.0), start


def _cell(k) -> str:
    return f"{k[0]} {k[1]} -> {k[2]} {k[3]:.1f}"


def replay_goals(rows: list[dict], judged: str = "adaptive") -> list[tuple[str, bool, str]]:
    """(goal, met, worst cell) per family of replay rows."""
    table = cells(rows, judged)
    out = []
    for fam in sorted({family(k) for k in table}):
        keys = [k for k in table if family(k) == fam and "adaptive" in table[k]]
        cross = [k for k in keys if _kind(k) in ("cross", "trace")]
        if cross:
            margins = [(verdict(table[k])["estimated_output_tokens_per_s"]["margin"], k) for k in cross]
            worst, key = min(margins)
            met = sum(m >= -TIE_PERCENT for m, _ in margins)
            best = verdict(table[key])["estimated_output_tokens_per_s"]["best"]
            scope = "cross-task" if fam != "decode traces" else "every"
            goal = f"{fam}: est. tokens/s >= every baseline, {scope} cell ({met} / {len(margins)})"
            out.append((goal, met == len(margins), f"{_cell(key)}: {worst:+.2f}% vs {best}"))
        same = [(_honest_default(table[k]), k) for k in keys if _kind(k) == "same"]
        same = [(v[0], v[1], k) for v, k in same if v is not None]
        if same:
            over, start, key = max(same)
            kept = sum(v <= TIE_PERCENT for v, _, _ in same)
            goal = f"{fam}: same-task honest default (time <= its start's + its copies; {kept} / {len(same)})"
            out.append((goal, kept == len(same), f"{_cell(key)}: {over:+.2f}% vs {start} + copies"))
        gaps = _belady_gaps(table, [k for k in cross if _kind(k) == "cross"] or cross)
        if gaps:
            mean = sum(g for g, _ in gaps) / len(gaps)
            worst, key = max(gaps)
            goal = (f"{fam}: mean hit-rate gap to Belady (same copy budget) at 0.1-0.4 <= {BELADY_GAP_POINTS:g} pt "
                    f"(mean {mean:.2f} pt over {len(gaps)} cells)")
            out.append((goal, mean <= BELADY_GAP_POINTS, f"{_cell(key)}: {worst:+.2f} pt"))
    return out


def placement_goals(path: str) -> list[tuple[str, bool, str]]:
    """The real-size goals of a bench placement --gpu-profile this-cpu JSON: the timed cells and the validation."""
    data = json.loads(Path(path).read_text())
    out, name = [], Path(path).stem
    timed = data.get("timed") or []
    if timed:
        cell = {(t["strategy"], round(t["ratio"], 6)): t for t in timed}
        checks = []
        for ratio in sorted({round(t["ratio"], 6) for t in timed}):
            for judged in ("adaptive", "time-balanced"):
                for base in ("uniform", "frequency"):
                    a, b = cell.get((judged, ratio)), cell.get((base, ratio))
                    if a and b:
                        spread = max(a["spread_output_tokens_per_s"], b["spread_output_tokens_per_s"])
                        gap = a["median_output_tokens_per_s"] - b["median_output_tokens_per_s"]
                        checks.append((gap + spread, gap, judged, base, ratio, b["median_output_tokens_per_s"]))
        if checks:
            slack, gap, judged, base, ratio, ref = min(checks)
            goal = (f"{name}: adaptive and time-balanced >= uniform and frequency, measured (median of rounds, "
                    f"within the spread; {sum(c[0] >= 0 for c in checks)} / {len(checks)})")
            out.append((goal, slack >= 0,
                        f"{judged} vs {base} at {ratio:.2f}: {100 * gap / ref:+.1f}% (spread {slack - gap:.2f} tok/s)"))
    if data.get("validation"):
        worst = max(data["validation"], key=lambda v: abs(v["relative_error"]))
        goal = f"{name}: cost-model validation within {100 * worst['tolerance']:.0f}%"
        out.append((goal, bool(data.get("validation_passed")),
                    f"{worst['strategy']} @ {worst['ratio']:.2f}: {100 * worst['relative_error']:+.1f}%"))
    return out


def goals_report(rows: list[dict], placement_files: list[str], judged: str) -> str:
    goals = replay_goals(rows, judged) + [g for path in placement_files for g in placement_goals(path)]
    lines = ["| goal | met | worst cell |", "|---|---|---|"]
    lines += [f"| {goal} | {'met' if met else 'NOT MET'} | {worst} |" for goal, met, worst in goals]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", help="JSON files: bench_cross_task.py --out or tiermoe bench dynamic --json")
    ap.add_argument("--markdown", help="write the report here too")
    ap.add_argument("--adaptive", default="adaptive", metavar="POLICY",
                    help="the policy judged, e.g. 'adaptive[sz05]' (a variant's rows; default: adaptive)")
    args = ap.parse_args()
    rows = [r for path in args.rows for r in load_rows(path)]
    placement_files = [path for path in args.rows if "cells" in json.loads(Path(path).read_text())]
    if rows and not any(r["policy"] == args.adaptive for r in rows):
        raise SystemExit(f"placement_verdict: no rows of policy {args.adaptive!r} in {', '.join(args.rows)}; "
                         f"present: {', '.join(sorted({r['policy'] for r in rows}))}")
    text = "Goals (issue 57):\n\n" + goals_report(rows, placement_files, args.adaptive)
    if rows:
        text += "\n" + report(rows, args.adaptive)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
