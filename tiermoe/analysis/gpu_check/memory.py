"""`--gpu-memory-gb auto` where the GPU's memory is the limit, as it is for users.

An H200 holds every expert of any test model, which would check nothing. So a ballast allocation first takes
all the free memory but what `auto` needs for about half the real-shape model's experts (found by planning
once without ballast: the plan says what it would leave for experts, so the ballast is that minus half the
experts' bytes). Then the plan must choose about half, the model must load, and serving 8 sequences with long
outputs (KV cache growing, the batcher's threads, CPU-tier transients) must finish without running out.
"""

from __future__ import annotations

import torch

from tiermoe.analysis.gpu_check.models import (
    NO_CUDA,
    checkpoint,
    model_shape,
    token_prompts,
)
from tiermoe.analysis.gpu_check.plan import CheckContext
from tiermoe.config import PlacementConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.model.plan_source import plan_from_config

HALF_BAND = (0.35, 0.65)  # "about half": the share of experts the plan must choose


def check_auto_memory_budget(ctx: CheckContext) -> dict:
    if not ctx.cuda:
        return NO_CUDA
    ckpt = checkpoint(ctx, "real")
    device = torch.device(ctx.device)
    config = PlacementConfig(strategy="uniform", gpu_memory_gb="auto")
    free_plan = plan_from_config(config, ckpt, ctx.device).budget
    per_expert = free_plan["bytes_per_expert"]
    spec, vocab = model_shape(ckpt)
    total_experts = spec.num_moe_layers * spec.num_experts
    prompts = token_prompts(8, 64, vocab, seed=6)
    ballast_bytes = int(free_plan["experts_bytes_per_gpu"] - (total_experts // 2 + 0.5) * per_expert)
    if ballast_bytes <= 0:
        return {"status": "fail", "error": "the GPU has less free memory than the model needs for half its experts",
                "plan_without_ballast": free_plan}
    ballast = torch.empty(ballast_bytes, dtype=torch.uint8, device=device)
    try:
        plan = plan_from_config(config, ckpt, ctx.device)
        share = plan.budget["total_gpu_experts"] / total_experts
        result = {"total_experts": total_experts, "ballast_gib": ballast_bytes / 2**30, "plan": plan.budget,
                  "planned_share": share}
        if not HALF_BAND[0] <= share <= HALF_BAND[1]:
            return {"status": "fail", "error": f"auto chose {share:.0%} of the experts, not about half", **result}
        free_before, total = torch.cuda.mem_get_info(device)
        torch.cuda.reset_peak_memory_stats(device)
        with LLM(ckpt, gpu_device=ctx.device, placement=plan, max_running=8, progress=False) as llm:
            on_gpu = int(llm.placement.sum())
            outs = llm.generate(prompts, SamplingParams(max_tokens=16 if ctx.quick else 256, ignore_eos=True))
            free_after, _ = torch.cuda.mem_get_info(device)
        errors = [o.error for o in outs if o.finish_reason == "error"]
        result.update({"gpu_experts_loaded": on_gpu, "free_gib_before_load": free_before / 2**30,
                       "free_gib_after_serving": free_after / 2**30,
                       "peak_allocated_gib": (torch.cuda.max_memory_allocated(device) - ballast_bytes) / 2**30,
                       "peak_reserved_gib": (torch.cuda.max_memory_reserved(device) - ballast_bytes) / 2**30,
                       "sequence_errors": errors[:3]})
        ok = on_gpu == plan.budget["total_gpu_experts"] and not errors
        return {"status": "pass" if ok else "fail", **result}
    finally:
        del ballast
        torch.cuda.empty_cache()
