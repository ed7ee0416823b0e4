"""`python -m tiermoe.analysis.gpu_check`: what `benchmarks/gpu_check.sh` runs on a GPU machine in one call.

On a make-model checkpoint (random weights, a real MoE layout) it checks and times CUDA hybrid inference:
1. exactness: fp32 logits at several GPU ratios against the all-CPU path;
2. CPU/GPU overlap: one MoE layer with both tiers busy against each tier alone;
3. pinned asynchronous copies: CPU-tier experts pinned, copies that return before they land, pinned vs pageable;
4. the `auto` memory budget (--gpu-memory-gb auto);
5. layerwise GPU prefill (DynamicPlacementConfig(prefill_threshold=...)): taken, and exact;
6. FP8 GPU-tier experts (an FP8 copy of the checkpoint): exact against its dequantised values, about 1 byte per
   parameter, codes kept through moves to the CPU tier and back, and the per-call dequantisation's time against a
   bf16 GPU tier;
7. serving throughput and time to first token at several ratios;
8. cost-model calibration: this GPU's profile measured with the GPU tier's own kernels (written as a JSON file for
   `tiermoe bench placement --gpu-profile FILE`), and the estimate a CPU-only machine would make with it,
   against the measurement.
Without CUDA every check that needs it says "skipped: no CUDA" and the rest runs on the CPU device (item 8 is
then the this-cpu validation), so the script is tested on CPU-only machines. Each check records pass / fail /
info / skipped and its figures; a failing check does not stop the others. Results: OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers

from tiermoe.analysis.gpu_check_items import (
    check_auto_budget,
    check_calibration,
    check_exactness,
    check_fp8_gpu_tier,
    check_layerwise_prefill,
    check_overlap,
    check_pinned_copies,
    check_serving,
    token_workload,
)
from tiermoe.arch import detect, load_config
from tiermoe.engine.llm import LLM
from tiermoe.testing.make_model import make_model

# make-model config overrides of qwen3_moe (on top of the tiny debug config)
SIZES = {
    "quick": {},  # the tiny debug model: 2 MoE layers x 8 experts, hidden 64
    "full": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4,
                 mlp_only_layers=[], num_experts=64, num_experts_per_tok=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=128, vocab_size=8192, max_position_embeddings=2048),
}


class Checker:
    """Runs named checks, records their outcome, never lets one failure stop the rest, and skips what would not
    finish within the time budget (the whole script must fit in one 10-minute call)."""

    def __init__(self, log, budget_seconds: float):
        self.log = log
        self.results: dict[str, dict] = {}
        self.deadline = time.perf_counter() + budget_seconds

    def run(self, name: str, fn, *args) -> None:
        if time.perf_counter() > self.deadline:
            self.results[name] = {"status": "skipped", "reason": "time budget spent"}
            self.log(f"[gpu-check] {name}: skipped (time budget spent)")
            return
        self.log(f"[gpu-check] {name} ...")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        start = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as err:  # a check that crashes is a failed check, reported, not fatal
            result = {"status": "fail", "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc(limit=6)}
        result["seconds"] = round(time.perf_counter() - start, 2)
        self.results[name] = result
        self.log(f"[gpu-check] {name}: {result['status']}" + (f" ({result['reason']})" if "reason" in result else "")
                 + (f" - {result['error']}" if "error" in result else ""))

    @property
    def failed(self) -> list[str]:
        return [k for k, v in self.results.items() if v["status"] == "fail"]


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
           "cpu_threads": torch.get_num_threads()}
    try:
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda_version"] = torch.version.cuda
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="directory for gpu_check.json (and the profile)")
    parser.add_argument("--quick", action="store_true", help="tiny model and workloads (the default without CUDA)")
    parser.add_argument("--budget-minutes", type=float, default=8.0,
                        help="start no check after this many minutes (default 8: the call must end within 10)")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    cuda = torch.cuda.is_available()
    quick = args.quick or not cuda
    device = "cuda:0" if cuda else "cpu"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {"environment": environment(), "size": "quick" if quick else "full", "device": device}
    if not cuda:
        log("[gpu-check] no CUDA: CUDA-only checks are skipped; the rest runs with the GPU tier on the CPU")
    checker = Checker(log, 60 * args.budget_minutes - (time.perf_counter() - started))
    with tempfile.TemporaryDirectory(prefix="tiermoe-gpu-check-") as tmp:
        ckpt = make_model("qwen3_moe", Path(tmp) / "ckpt", config_overrides=SIZES["quick" if quick else "full"],
                          progress=False)

        spec = detect(load_config(ckpt))
        report["checkpoint"] = {"moe_layers": spec.num_moe_layers, "experts": spec.num_experts, "top_k": spec.top_k,
                                "hidden": spec.hidden_size, "expert_intermediate": spec.expert_intermediate_size,
                                "bytes_per_expert_bf16": spec.bytes_per_expert(torch.bfloat16)}
        vocab = int(load_config(ckpt).vocab_size)
        n, plen, olen = (8, 24, 8) if quick else (24, 128, 48)
        workloads = (token_workload("calibration", n, plen, olen, vocab, 1),
                     token_workload("held-out", n, plen, olen, vocab, 2))
        ratios = (0.0, 0.5, 1.0) if quick else (0.0, 0.25, 0.5, 0.75, 1.0)
        checker.run("exactness", check_exactness, ckpt, device, ratios)
        checker.run("layerwise_prefill", check_layerwise_prefill, ckpt, device, 16 if quick else 64)
        checker.run("auto_memory_budget", check_auto_budget, ckpt, device)
        checker.run("fp8_gpu_tier", check_fp8_gpu_tier, ckpt, device, Path(tmp))
        with LLM(ckpt, gpu_device=device, progress=False) as llm:
            checker.run("pinned_async_copies", check_pinned_copies, llm)
            checker.run("cpu_gpu_overlap", check_overlap, llm, 16 if quick else 128)
            checker.run("serving", check_serving, llm, workloads[1], ratios, 4 if quick else 8)
        checker.run("cost_model_calibration", check_calibration, ckpt, device, out_dir, workloads,
                    (0.25, 0.5, 0.75) if not quick else (0.5,), quick)
    report["checks"] = checker.results
    report["failed"] = checker.failed
    report["seconds"] = round(time.perf_counter() - started, 1)
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    log(f"[gpu-check] wrote {path}: " + ", ".join(f"{k} {v['status']}" for k, v in checker.results.items()))
    return 1 if checker.failed else 0


if __name__ == "__main__":
    sys.exit(main())
