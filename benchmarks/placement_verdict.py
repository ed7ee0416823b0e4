"""Per cell of a placement replay: is adaptive at or above every baseline, and how far below the oracles?

Reads the rows of `benchmarks/bench_cross_task.py --out` or of `tiermoe bench dynamic --json` (several files at
once; a bench dynamic file is labelled by its name and GPU profile) and writes, per (GPU profile, calibration ->
replayed, ratio) cell: adaptive's hit rate and estimated tokens/s, the best baseline in each (every static strategy
present, KT dynamic, LRU, LFU) and by how much adaptive is above or below it, and the hit-rate gaps to the
per-request and per-window oracles at ratios up to 0.4 (the issue's goal: within 10 points). Nothing is replayed:
it reads the rows.

    python benchmarks/placement_verdict.py benchmarks/results/cross_task_full.json \\
        --markdown benchmarks/results/cross_task_full_verdict.md

`--adaptive 'adaptive[NAME]'` judges a variant replayed beside it (bench_cross_task.py --adaptive-variant) instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BASELINES = ("uniform", "front-loading", "random", "frequency", "balanced", "kt-dynamic", "lru", "lfu")
# the oracles a gap is reported to: (policy, column label), hindsight and free copies (tiermoe.analysis.trace_replay)
ORACLE_GAPS = (("oracle-request", "per-request oracle"), ("oracle-window", "per-window oracle"))
FIELDS = (("hit_rate", "hit rate", 100.0, "pt"), ("estimated_output_tokens_per_s", "est. tokens/s", None, "%"))


def load_rows(path: str) -> list[dict]:
    data = json.loads(Path(path).read_text())
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
    lines += ["", "Per cell: adaptive's hit rate and estimated tokens/s, the best baseline in each and adaptive's margin "
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", nargs="+", help="JSON files: bench_cross_task.py --out or tiermoe bench dynamic --json")
    ap.add_argument("--markdown", help="write the report here too")
    ap.add_argument("--adaptive", default="adaptive", metavar="POLICY",
                    help="the policy judged, e.g. 'adaptive[sz05]' (a variant's rows; default: adaptive)")
    args = ap.parse_args()
    rows = [r for path in args.rows for r in load_rows(path)]
    if not any(r["policy"] == args.adaptive for r in rows):
        raise SystemExit(f"placement_verdict: no rows of policy {args.adaptive!r} in {', '.join(args.rows)}; "
                         f"present: {', '.join(sorted({r['policy'] for r in rows}))}")
    text = report(rows, args.adaptive)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
