"""Peak host memory while loading a multi-GB checkpoint into tiers, against the bytes the tiers end up holding.

The loader must never hold a second copy of the model: peak resident memory (ru_maxrss of a fresh process
that only imports, loads and exits) stays within what the tiers and non-expert weights hold in host memory plus
1 GB (interpreter, torch, transformers). Here gpu_device="cpu", so both tiers are host memory.

    python benchmarks/bench_load_memory.py --preset qwen3-30b-a3b --layers 4 --dir scratch/tiermoe-bench/q30b-4l
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# Made checkpoints go to the system's temporary folder unless --dir says otherwise: they are scratch, remade
# when missing, and a few GB each.
SCRATCH = Path(tempfile.gettempdir()) / "tiermoe-bench"

CHILD = r"""
import json, resource, sys, torch
import tiermoe  # noqa: F401
from tiermoe.model.loader import load_hybrid_model
from tiermoe.arch import detect, load_config
import transformers  # noqa: F401  (imported before the baseline, like the loader needs it)
spec = detect(load_config(sys.argv[1]))
g = torch.Generator().manual_seed(0)
mask = torch.rand(spec.num_layers, spec.num_experts, generator=g) < float(sys.argv[2])
base = int(open("/proc/self/statm").read().split()[1]) * 4096
model = load_hybrid_model(sys.argv[1], mask, gpu_device="cpu", progress=True)
tb = model.tier_bytes()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"baseline_rss": base, "peak_rss": peak, "non_expert": tb.non_expert,
                  "gpu_experts": tb.gpu_experts, "cpu_experts": tb.cpu_experts}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", default=str(SCRATCH / "q30b-4l"))
    parser.add_argument("--gpu-fraction", type=float, default=0.5, help="share of experts on the GPU tier")
    args = parser.parse_args()

    model_dir = Path(args.dir)
    if not (model_dir / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tiermoe.cli.main", "make-model", "--arch", args.arch, "--preset",
                        args.preset, "--layers", str(args.layers), "--out", str(model_dir)], check=True)
    result = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), str(args.gpu_fraction)],
                            check=True, stdout=subprocess.PIPE, text=True)
    r = json.loads(result.stdout.strip().splitlines()[-1])
    gib = 1024**3
    held = r["non_expert"] + r["gpu_experts"] + r["cpu_experts"]
    on_disk = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    rows = [
        ("checkpoint on disk", on_disk),
        ("non-expert weights (main device)", r["non_expert"]),
        ("GPU-tier experts", r["gpu_experts"]),
        ("CPU-tier experts", r["cpu_experts"]),
        ("held by the tiers, total", held),
        ("RSS before loading (interpreter + libraries)", r["baseline_rss"]),
        ("peak RSS during the whole load", r["peak_rss"]),
        ("peak RSS - held", r["peak_rss"] - held),
    ]
    print(f"\n{'quantity':<48}{'GiB':>10}")
    for name, value in rows:
        print(f"{name:<48}{value / gib:>10.3f}")
    slack = r["peak_rss"] - held
    verdict = "PASS" if slack <= gib else "FAIL"
    print(f"\npeak RSS exceeds the held bytes by {slack / gib:.3f} GiB (limit 1 GiB): {verdict}")
    print(f"peak / held = {r['peak_rss'] / held:.3f} (a second copy of the model would be >= 2)")
    sys.exit(0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    main()
