"""Copies between the tiers on CUDA: from pinned memory, asynchronous, and landing the right bytes.

Through the path a swap takes (HybridMoE.start_move and the AsyncCopier) at real expert sizes, each of these can
fail: the memory a promotion copies from is pinned (from pageable memory a "non-blocking" copy blocks the
host); starting the copies returns well before they land; what lands equals the source, both ways; and pinned
copies are not slower than pageable ones.
"""

from __future__ import annotations

import time

import torch

from tiermoe.analysis.device_profile import best_time
from tiermoe.analysis.gpu_check.models import (
    NO_CUDA,
    checkpoint,
    model_shape,
    uniform_mask,
)
from tiermoe.analysis.gpu_check.plan import CheckContext
from tiermoe.engine.llm import LLM
from tiermoe.experts.copier import AsyncCopier

ASYNC_SHARE = 0.5  # starting the copies may take at most this share of the time until they have all landed


def check_pinned_copies(ctx: CheckContext) -> dict:
    if not ctx.cuda:
        return NO_CUDA
    ckpt = checkpoint(ctx, "real")
    device = torch.device(ctx.device)
    with LLM(ckpt, gpu_device=ctx.device, dtype=torch.bfloat16, progress=False,
             placement=uniform_mask(model_shape(ckpt)[0], 0.5)) as llm:
        block = next(iter(llm.hybrid.blocks.values()))
        on_cpu = [e for e in range(llm.hybrid.spec.num_experts) if e in block.cpu_tier]
        on_gpu = [e for e in range(llm.hybrid.spec.num_experts) if e in block.gpu_tier]
        sources = [block.cpu_tier.get(e) for e in on_cpu]
        result = {"experts": len(on_cpu), "bytes": sum(w.nbytes for w in sources),
                  "cpu_tier_pinned": all(t.is_pinned() for w in sources for t in w.tensors())}
        copier = AsyncCopier()
        try:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            tickets = [block.start_move(e, True, copier) for e in on_cpu]
            started = time.perf_counter() - start
            landed_at_return = sum(t.landed() for t in tickets)
            promoted = [t.result() for t in tickets]
            landed = time.perf_counter() - start
            result["promotions_equal"] = all(
                torch.equal(a.cpu(), b) for w, src in zip(promoted, sources) for a, b in zip(w.tensors(), src.tensors()))
            demoted = [t.result() for t in [block.start_move(e, False, copier) for e in on_gpu]]
            result["demotions_pinned"] = all(t.is_pinned() for w in demoted for t in w.tensors())
            result["demotions_equal"] = all(
                torch.equal(a, b.cpu()) for w, e in zip(demoted, on_gpu)
                for a, b in zip(w.tensors(), block.gpu_tier.get(e).tensors()))
        finally:
            copier.close()
        pageable = [[t.clone() for t in w.tensors()] for w in sources]  # fresh host memory: never pinned

        def copy_pageable():
            for tensors in pageable:
                for t in tensors:
                    t.to(device)

        t_pageable = best_time(copy_pageable, lambda: torch.cuda.synchronize(device), 3)
    result.update({"start_ms": 1e3 * started, "landed_ms": 1e3 * landed, "landed_when_start_returned": landed_at_return,
                   "pinned_async_gb_s": result["bytes"] / landed / 1e9, "pageable_gb_s": result["bytes"] / t_pageable / 1e9})
    problems = [text for ok, text in (
        (result["cpu_tier_pinned"], "the CPU tier's experts (what a promotion copies from) are not pinned"),
        (started <= ASYNC_SHARE * landed, f"starting the copies took {1e3 * started:.1f} ms of the "
                                          f"{1e3 * landed:.1f} ms until they landed: they block the host"),
        (result["promotions_equal"], "a promoted expert landed with other bytes"),
        (result["demotions_equal"], "a demoted expert landed with other bytes"),
        (result["demotions_pinned"], "demoted experts land in pageable memory"),
        (result["pinned_async_gb_s"] >= result["pageable_gb_s"], "pinned copies are slower than pageable ones"),
    ) if not ok]
    return {"status": "fail" if problems else "pass", **({"problems": problems} if problems else {}), **result}
