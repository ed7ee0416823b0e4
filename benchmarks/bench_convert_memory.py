"""Peak host memory while converting experts to int4, against the bound: the CPU tier's final size plus a small
buffer (issue 13).

Four cases, each in a fresh process (peak = VmHWM; growth = peak less the resident size after imports):
  convert      `tiermoe convert --cpu-expert-dtype int4` of a bf16 make-model checkpoint (streams to disk)
  load-bf16    loading that checkpoint with the CPU tier in int4 (converted while streaming), all experts on CPU
  load-fp8     the same from its FP8 block-quantised version (experts dequantised and converted while streaming)
  load-cache   loading the `convert` output: the CPU tier memory-maps it, nothing is converted
gpu_device="cpu", so the non-expert weights are host memory too; the bound for the loads is therefore
non-expert + CPU-tier bytes (what the model holds) + buffer, and for `convert` the buffer alone.

    python benchmarks/bench_convert_memory.py --dir scratch/tiermoe-bench/q30b-4l --work scratch/tiermoe-bench/convert
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Made checkpoints go to the system's temporary folder unless --dir says otherwise: they are scratch, remade
# when missing, and a few GB each.
SCRATCH = Path(tempfile.gettempdir()) / "tiermoe-bench"

CHILD = r"""
import json, sys, time, torch
import transformers  # noqa: F401
import tiermoe.convert, tiermoe.model.loader  # noqa: F401  (imports in before the baseline)
import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401  (the model class the loader builds)
from tiermoe.experts.kernels import load_kernels
load_kernels()  # the CPU kernels' library, loaded (built once) before the baseline too
from tiermoe.config import CPUConfig
case, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
base = int(open("/proc/self/statm").read().split()[1]) * 4096
t = time.perf_counter()
held = 0
if case == "convert":
    from tiermoe.convert import convert_cpu_experts
    convert_cpu_experts(path, "int4", out, progress=False)
    held = sum(f.stat().st_size for f in __import__("pathlib").Path(out).glob("layer-*.safetensors"))
    tiers = {"cache_bytes": held}
    held = 0  # streamed to disk: nothing is held
else:
    from tiermoe.model.loader import load_hybrid_model
    cpu = CPUConfig() if case == "load-cache" else CPUConfig(expert_dtype="int4")
    model = load_hybrid_model(path, None, gpu_device="cpu", cpu=cpu, progress=False)
    tb = model.tier_bytes()
    held = tb.non_expert + tb.gpu_experts + tb.cpu_experts
    tiers = {"non_expert": tb.non_expert, "cpu_experts": tb.cpu_experts}
seconds = time.perf_counter() - t
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"case": case, "baseline": base, "peak": peak, "held": held, "seconds": seconds, **tiers}))
"""


def run_case(case: str, path: Path, out: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, case, str(path), str(out)], check=True, stdout=subprocess.PIPE,
                       text=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", default=str(SCRATCH / "q30b-4l"), help="bf16 checkpoint (made if missing)")
    parser.add_argument("--work", default=str(SCRATCH / "convert"), help="FP8 copy and int4 cache go here")
    args = parser.parse_args()

    src, work = Path(args.dir), Path(args.work)
    if not (src / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tiermoe.cli.main", "make-model", "--arch", "qwen3_moe", "--preset",
                        args.preset, "--layers", str(args.layers), "--out", str(src)], check=True)
    fp8, cache = work / "fp8", work / "int4"
    if not (fp8 / "config.json").exists():  # in a child, so this process stays small while it measures
        shutil.rmtree(fp8, ignore_errors=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import sys; from tiermoe.testing.fp8_write import write_fp8_checkpoint; "
                        "write_fp8_checkpoint(sys.argv[1], sys.argv[2])", str(src), str(fp8)], check=True)
        print(f"wrote FP8 copy in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    shutil.rmtree(cache, ignore_errors=True)
    results = [run_case("convert", src, cache), run_case("load-bf16", src, cache),
               run_case("load-fp8", fp8, cache), run_case("load-cache", cache, cache)]
    gib = 1 << 30
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))
    print(f"source: {args.preset} x {args.layers} layers, bf16 {size(src) / gib:.2f} GiB on disk, "
          f"FP8 {size(fp8) / gib:.2f} GiB, int4 cache {results[0]['cache_bytes'] / gib:.2f} GiB\n")
    print("| case | time (s) | held by the model (GiB) | peak growth (GiB) | growth - held (GiB) |")
    print("|---|---|---|---|---|")
    for r in results:
        growth = r["peak"] - r["baseline"]
        print(f"| {r['case']} | {r['seconds']:.0f} | {r['held'] / gib:.2f} | {growth / gib:.2f} | "
              f"{(growth - r['held']) / gib:+.2f} |")
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
