"""The GPU check's look at attention over the KV pool: decode rows read the past where it lies on this device.

On CUDA the decode rows attend through the Triton kernel (tiermoe.layers.triton_paged_attention). One decode step
at a past of 1k and one at 16k must write the same bytes of K/V (tiermoe.testing.step_bytes: a gathering step
writes each layer's past again, 16x more at 16k), and the greedy tokens at both pasts must equal the CPU run's. A
rehearsal on the CPU (quick) takes pasts of 64 and 192 on the Triton interpreter (TRITON_INTERPRET=1, which the
suite sets).
"""

from __future__ import annotations

import time

import torch

from tiermoe.analysis.gpu_check.models import tiny_checkpoint
from tiermoe.analysis.gpu_check.plan import CheckContext
from tiermoe.engine.llm import LLM
from tiermoe.testing.step_bytes import decode_step_bytes

PAGE = 16


def check_attention_in_place(ctx: CheckContext) -> dict:
    path = tiny_checkpoint(ctx, "qwen3_moe", long_context=True)
    pasts = (64, 192) if ctx.quick else (1024, 16384)
    pool = 2 * max(pasts) + 64
    runs = {}
    for label, device, backend in (("device", ctx.device, "auto" if ctx.cuda else "triton"), ("cpu", "cpu", "torch")):
        with LLM(path, gpu_device=device, dtype=torch.float32, page_size=PAGE, max_total_tokens=pool,
                 progress=False, attention_backend=backend) as llm:
            kernel = type(llm.engine.decode_attention).__name__
            started = time.perf_counter()
            found = {past: decode_step_bytes(llm, past) for past in pasts}
            runs[label] = {
                "decode_attention": kernel, "seconds": round(time.perf_counter() - started, 2),
                "decode_step_kv_bytes": {str(p): b for p, (b, _) in found.items()},
                "tokens": {str(p): t for p, (_, t) in found.items()}}
    ours, cpu = runs["device"], runs["cpu"]
    flat = len(set(ours["decode_step_kv_bytes"].values())) == 1
    equal = ours["tokens"] == cpu["tokens"]
    in_place = ours["decode_attention"] == "TritonPagedAttention"
    return {"status": "pass" if flat and equal and in_place else "fail", "on": ctx.device, "pasts": pasts,
            "bytes_flat_in_the_past": flat, "tokens_equal_cpu": equal, **runs}
