"""`python -m tiermoe.analysis.gpu_check` (__main__.py runs main()): what `benchmarks/gpu_check.sh` runs on a GPU machine in one call.

The plan (tiermoe.analysis.gpu_check.plan) in the value order environment -> exactness -> syncs/overlap ->
serving -> memory -> layerwise -> FP8 -> profile, each check in its own process within its own budget
(tiermoe.analysis.gpu_check.runner), on make-model checkpoints (random weights, real layouts; one with a real
layer's shapes). Results: OUT/gpu_check.jsonl (a line per check as it ends) and OUT/gpu_check.json (the report,
rewritten after each check), OUT/decode_profile.txt and OUT/gpu_profile.json.

Without CUDA every check is reported "skipped: no CUDA". `--rehearse` runs them anyway with the GPU tier on
the CPU device and tiny models (the CUDA-only parts then say skipped), so their code is tested on machines
without a GPU; `--dry-run` prints the plan, the wheels carried and the budgets, and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

from tiermoe.analysis.gpu_check.plan import (
    LIMIT_S,
    SETUP_S,
    CheckContext,
    check_plan,
    plan_text,
    read_requirements,
    select,
    wheel_files,
)
from tiermoe.analysis.gpu_check.runner import ResultLog, run_plan

VERSIONED = ("torch", "transformers", "huggingface_hub", "tokenizers", "safetensors", "gguf", "numpy", "regex",
             "accelerate")


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def cuda_summary() -> dict:
    if not torch.cuda.is_available():
        return {"cuda": False, "torch_cuda": torch.version.cuda}
    return {"cuda": True, "torch_cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0)))}


def no_cuda_reason() -> str | None:
    if torch.cuda.is_available():
        return None
    return f"no CUDA (torch {torch.__version__} sees no CUDA device: torch.cuda.is_available() is False)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results",
                        help="folder for the results (default $OUT, else benchmarks/results)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, the wheels and the budgets; run nothing")
    parser.add_argument("--rehearse", action="store_true",
                        help="without CUDA: run the checks with the GPU tier on the CPU device and tiny models")
    parser.add_argument("--quick", action="store_true", help="tiny models (implied by --rehearse)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the checks in this process (no isolation, overruns only reported)")
    parser.add_argument("--only", help="comma-separated check names (default: all, in plan order)")
    parser.add_argument("--limit", type=float, default=LIMIT_S - SETUP_S,
                        help="seconds this run may take (the shell passes what its set-up left)")
    parser.add_argument("--setup-seconds", type=float, default=None, help="what the shell's set-up took (report)")
    parser.add_argument("--wheels", default="benchmarks/gpu_wheels", help="the carried wheels' folder")
    parser.add_argument("--requirements", default="benchmarks/gpu_wheels.txt", help="the carried wheels' pins")
    args = parser.parse_args(argv)
    try:
        checks = select(args.only)
    except ValueError as err:
        parser.error(str(err))
    check_plan()
    skip = None if args.rehearse else no_cuda_reason()
    if args.dry_run:
        pins = read_requirements(Path(args.requirements))
        print(plan_text(checks, LIMIT_S, SETUP_S, pins, wheel_files(pins, Path(args.wheels)), skip))
        return 0

    def log(message: str) -> None:
        print(message, flush=True)

    started = time.time()
    device = "cuda:0" if torch.cuda.is_available() and not args.rehearse else "cpu"
    if device == "cpu":  # a rehearsal runs the Triton kernels on the host: under Triton's interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    header = {"versions": versions(), **cuda_summary(), "device": device, "rehearsal": args.rehearse,
              "limit_s": args.limit, "setup_seconds": args.setup_seconds,
              "plan": [{"name": c.name, "stage": c.stage, "budget_s": c.budget_s} for c in checks]}
    log("[gpu-check] " + ", ".join(f"{k} {v}" for k, v in header["versions"].items() if v) + f"; device {device}"
        + (f" ({header['gpu']}, capability {header['capability']})" if header.get("gpu") else ""))
    if skip:
        log(f"[gpu-check] {skip}: every check is skipped")
    work_dir = tempfile.mkdtemp(prefix="tiermoe-gpu-check-")
    try:
        base = CheckContext(device, str(Path(args.out).resolve()), work_dir, args.quick or args.rehearse, 0.0)
        report = run_plan(checks, base, ResultLog(Path(args.out), header), started + args.limit, skip,
                          args.in_process, log)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    counts = {}
    for result in report["checks"].values():
        counts[result["status"]] = counts.get(result["status"], 0) + 1
    log(f"[gpu-check] done in {time.time() - started:.0f} s: " + ", ".join(f"{n} {s}" for s, n in counts.items())
        + (f"; failed: {', '.join(report['failed'])}" if report["failed"] else ""))
    return 1 if report["failed"] else 0

