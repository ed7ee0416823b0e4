"""A torch.profiler table of one decode step, saved to $OUT/decode_profile.txt.

What the numbers of the other checks cannot say: where one decode step of 8 sequences at real layer shapes
spends its time, on the host and on the GPU, kernel by kernel (the GPU machine checked has no Nsight Systems that
makes reports, and one step is what the per-token cost is made of).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tiermoe.analysis.gpu_check.models import checkpoint, model_shape, uniform_mask
from tiermoe.analysis.gpu_check.plan import CheckContext
from tiermoe.analysis.gpu_check.syncs import decode_ready
from tiermoe.engine.llm import LLM

ROWS = 40


def check_decode_profile(ctx: CheckContext) -> dict:
    ckpt = checkpoint(ctx, "real")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with LLM(ckpt, gpu_device=ctx.device, dtype=torch.bfloat16, progress=False, max_running=8,
             placement=uniform_mask(model_shape(ckpt)[0], 0.5)) as llm:
        decode_ready(llm)
        start = time.perf_counter()
        llm.engine.step()
        step_ms = 1e3 * (time.perf_counter() - start)
        with profile(activities=activities, record_shapes=False) as prof:
            llm.engine.step()
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
    averages = prof.key_averages()
    tables = [f"one decode step, 8 sequences, {ckpt.name} checkpoint, ratio 0.5, device {ctx.device}; "
              f"unprofiled step {step_ms:.2f} ms"]
    sorts = ("self_device_time_total", "cpu_time_total") if ctx.cuda else ("cpu_time_total",)
    for key in sorts:
        tables += [f"\n--- sorted by {key} ---", averages.table(sort_by=key, row_limit=ROWS)]
    path = Path(ctx.out_dir) / "decode_profile.txt"
    path.write_text("\n".join(tables) + "\n")
    top = sorted(averages, key=lambda e: e.self_device_time_total if ctx.cuda else e.self_cpu_time_total,
                 reverse=True)[:5]
    result = {"file": str(path), "step_ms_unprofiled": step_ms,
              "top_ops": [{"name": e.key, "calls": e.count,
                           "self_ms": (e.self_device_time_total if ctx.cuda else e.self_cpu_time_total) / 1e3}
                          for e in top]}
    return {"status": "info", **({} if ctx.cuda else {"reason": "no CUDA: host time only"}), **result}
