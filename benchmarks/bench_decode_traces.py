"""The Qwen3-30B-A3B and gpt-oss-120b decode traces replayed through every policy of `tiermoe bench dynamic`, on
both GPU profiles, in one command (what BENCHMARKS.md's decode-trace tables ran as four `tiermoe bench dynamic`
commands): `qwen.route.csv` (top-6 forced, 28 prefill + 128 decode tokens) calibrated on the published Qwen3-30B-A3B
decode heat, `gptoss.route.csv` (top-2 forced, 85 + 64) with no calibration; costed with bf16 experts of each
model's config (Qwen3-30B-A3B's preset; gpt-oss-120b = the gpt-oss-20b preset with 36 layers and 128 experts, its
published shape). Writes `decode_<trace>_<profile>.json` in `bench dynamic --json`'s format, which
benchmarks/placement_verdict.py reads. Estimates: seconds, whatever the load.

    PYTHONPATH=$PWD python benchmarks/bench_decode_traces.py --data data/routing --out benchmarks/results

Variants of the adaptive policy are replayed beside it as `adaptive[NAME]` rows (AdaptiveSettings fields, as
bench_cross_task.py takes them), and placement_verdict.py judges one with `--adaptive 'adaptive[NAME]'`:

    PYTHONPATH=$PWD python benchmarks/bench_decode_traces.py --data data/routing --out scratch/variants \
        --adaptive-variant flat:cross_layer=0 --adaptive-variant short:recent_half_life_tokens=6
    python benchmarks/placement_verdict.py scratch/variants/decode_*.json --adaptive 'adaptive[flat]'
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

# benchmarks/, beside this file
from bench_cross_task import parse_variant, variant_rows

from tiermoe.analysis.dynamic_bench import (
    DEFAULT_RATIOS,
    replay_cost_model,
    run_dynamic_bench,
)
from tiermoe.analysis.trace_replay import trace_passes
from tiermoe.arch import detect
from tiermoe.config import AdaptiveSettings
from tiermoe.placement.profiles import load_profile
from tiermoe.routing.trace_convert import detect_layout, read_routing
from tiermoe.stats.io import load_counts
from tiermoe.testing.presets import make_config

TRACES = {  # name: (trace file, heat file or None, arch, preset, config overrides)
    "qwen": ("decode-route-traces/qwen.route.csv", "qwen3-moe-heat/heat_qwen3-30b-a3b.csv", "qwen3_moe",
             "qwen3-30b-a3b", {}),
    "gptoss": ("decode-route-traces/gptoss.route.csv", None, "gpt_oss", "gpt-oss-20b",
               {"num_hidden_layers": 36, "num_local_experts": 128}),
}


def run(data: Path, name: str, profile: str, copy_budget: int = 4,
        variants: list[tuple[str, dict]] = ()) -> dict:
    trace_file, heat, arch, preset, overrides = TRACES[name]
    passes = trace_passes(read_routing(data / trace_file, detect_layout(data / trace_file)))
    spec = detect(make_config(arch, preset, **overrides))
    calibration = load_counts(str(data / heat), passes.num_layers, passes.num_experts) if heat else None
    gpu = load_profile(profile)
    adaptive = AdaptiveSettings(max_swaps_in_flight=copy_budget).for_ranks(1)
    cost = replay_cost_model(spec, gpu)
    bench = run_dynamic_bench(passes, cost, DEFAULT_RATIOS, calibration, copy_budget=copy_budget, adaptive=adaptive)
    rows = bench.rows + variant_rows(passes, cost, DEFAULT_RATIOS, calibration, copy_budget, variants)
    return {"gpu_profile": gpu.as_dict(), "passes": passes.num_passes, "adaptive": asdict(adaptive),
            "variants": dict(variants), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="the routing data folder (data/routing)")
    ap.add_argument("--out", required=True, help="folder for decode_<trace>_<profile>.json")
    ap.add_argument("--traces", default="qwen,gptoss")
    ap.add_argument("--profiles", default="rtx4090,h200")
    ap.add_argument("--adaptive-variant", action="append", default=[], type=parse_variant, metavar="NAME:FIELD=V,...",
                    help="also replay adaptive with these AdaptiveSettings fields, as rows 'adaptive[NAME]' "
                         "(repeatable; bools as 0 / 1)")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for name in args.traces.split(","):
        for profile in args.profiles.split(","):
            path = Path(args.out) / f"decode_{name}_{profile}.json"
            path.write_text(json.dumps(run(Path(args.data), name, profile, variants=args.adaptive_variant)))
            print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
