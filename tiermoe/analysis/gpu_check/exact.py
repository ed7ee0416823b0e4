"""Exactness on CUDA: the results tiermoe gives on a GPU are the results it gives without one.

- fp32 logits at every GPU ratio against the all-CPU run (fp32 CPU-tier experts use the torch path);
- bf16 with the native C++ kernels computing the CPU tier at ratio 0.5: the CUDA run against the same run with
  the GPU tier on the CPU device, both against fp32 (bf16 cannot be exact: CUDA must be no worse than the CPU);
- greedy generation of 8 prompts batched together against each prompt alone (batching changes no token);
- dynamic placement (adaptive swaps, and kt-dynamic's burst of swaps after a large prefill) against static;
- the engine itself (Engine steps over the paged pool, 8 sequences of mixed lengths, chunked) against the
  unmodified transformers model on the same GPU, fp32, on a tiny GPT-OSS (sinks, sliding window) and a tiny
  DeepSeek-V3 (MLA), the suite's own test (tiermoe.testing.pool_exactness), with the GPU tier's kernel recorded.
"""

from __future__ import annotations

import torch

from tiermoe.analysis.gpu_check.models import (
    EXACT_TOLERANCE,
    TINY_ARCHS,
    argmax_agreement,
    checkpoint,
    first_difference,
    logits,
    model_shape,
    rel_err,
    tiny_checkpoint,
    token_prompts,
    uniform_mask,
    vocab_of,
)
from tiermoe.analysis.gpu_check.plan import CheckContext
from tiermoe.arch import detect, load_config
from tiermoe.config import AdaptiveSettings, CPUConfig, DynamicPlacementConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.slotted_tier import SlottedExpertSet
from tiermoe.testing.pool_exactness import eight_sequences_against

# bf16 is judged against the CPU device's own bf16 error (4 layers of random weights: about 5% of the largest
# logit here), not against a fixed tolerance: CUDA must be no worse than the CPU.
ERROR_FACTOR = 2.0  # CUDA's error against fp32 may be this many times the CPU device's (+ 1e-3)
AGREEMENT_SLACK = 0.05  # CUDA's argmax agreement with fp32 may be this much below the CPU run's


ENGINE_ARCHS = TINY_ARCHS
ENGINE_TOLERANCE = 1e-5  # the suite's bound for the same comparison on the CPU (observed <= 2e-6 there)


def check_engine_vs_transformers(ctx: CheckContext) -> dict:
    from transformers import AutoModelForCausalLM

    results = {}
    for arch in ENGINE_ARCHS:
        path = tiny_checkpoint(ctx, arch)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(ctx.device).eval()
        with LLM(path, placement=uniform_mask(detect(load_config(path)), 0.5), gpu_device=ctx.device,
                 dtype=torch.float32, max_running=8, page_size=4, progress=False) as llm:
            found = eight_sequences_against(llm, reference)
            pools = {id(b.gpu_tier.pool): b.gpu_tier.pool for b in llm.hybrid.blocks.values()
                     if isinstance(b.gpu_tier, SlottedExpertSet) and b.gpu_tier.pool.stacks is not None}
            choices = [p.kernel(torch.float32) for p in pools.values()]
            kernels = sorted({f"{c.name} ({c.why})" for c in choices})
            attention = type(llm.engine.decode_attention).__name__  # on CUDA: TritonPagedAttention, in place
        del reference
        results[arch] = {"relative_error": found.worst_rel_err, "greedy_tokens_equal": found.tokens_equal,
                         "forwards": found.forwards, "pages_left": found.pages_left, "gpu_tier_kernels": kernels,
                         "decode_attention": attention}
    passed = all(r["relative_error"] <= ENGINE_TOLERANCE and r["greedy_tokens_equal"] and not r["pages_left"]
                 for r in results.values())
    return {"status": "pass" if passed else "fail", "device": ctx.device, "tolerance": ENGINE_TOLERANCE, **results}


def check_exactness_fp32(ctx: CheckContext) -> dict:
    ckpt = checkpoint(ctx, "small")
    ratios = (0.0, 0.5, 1.0) if ctx.quick else (0.0, 0.25, 0.5, 0.75, 1.0)
    with LLM(ckpt, gpu_device="cpu", dtype=torch.float32, progress=False) as ref_llm:
        ids = torch.tensor(token_prompts(2, 32, vocab_of(ref_llm), seed=1))
        ref = logits(ref_llm, ids)
        spec = ref_llm.hybrid.spec
    errors = {}
    with LLM(ckpt, gpu_device=ctx.device, dtype=torch.float32, progress=False) as llm:
        for ratio in ratios:  # one load, experts moved between tiers for each ratio
            llm.hybrid.apply_mask(uniform_mask(spec, ratio))
            errors[f"{ratio:g}"] = rel_err(logits(llm, ids), ref)
    worst = max(errors.values())
    return {"status": "pass" if worst <= EXACT_TOLERANCE else "fail", "device": ctx.device,
            "relative_error_by_ratio": errors, "tolerance": EXACT_TOLERANCE}


def check_exactness_bf16_native(ctx: CheckContext) -> dict:
    ckpt = checkpoint(ctx, "small")
    with LLM(ckpt, gpu_device="cpu", dtype=torch.float32, progress=False) as ref_llm:
        ids = torch.tensor(token_prompts(4, 64, vocab_of(ref_llm), seed=2))
        ref = logits(ref_llm, ids)
        mask = uniform_mask(ref_llm.hybrid.spec, 0.5)
    native = CPUConfig(backend="native")
    with LLM(ckpt, gpu_device="cpu", dtype=torch.bfloat16, placement=mask, cpu=native, progress=False) as llm:
        on_cpu = logits(llm, ids)
        path = cpu_tier_path(llm)
    result = {"cpu_tier_path": path, "positions": ids.numel(),
              "cpu_device": {"relative_error_vs_fp32": rel_err(on_cpu, ref),
                             "argmax_agreement_vs_fp32": argmax_agreement(on_cpu, ref)}}
    if not ctx.cuda:
        return {"status": "skipped", "reason": "no CUDA (the CPU-device run alone was measured)", **result}
    with LLM(ckpt, gpu_device=ctx.device, dtype=torch.bfloat16, placement=mask, cpu=native, progress=False) as llm:
        on_cuda = logits(llm, ids)
    result["cuda"] = {"relative_error_vs_fp32": rel_err(on_cuda, ref),
                      "argmax_agreement_vs_fp32": argmax_agreement(on_cuda, ref),
                      "relative_error_vs_cpu_device": rel_err(on_cuda, on_cpu),
                      "argmax_agreement_vs_cpu_device": argmax_agreement(on_cuda, on_cpu)}
    cpu, cuda = result["cpu_device"], result["cuda"]
    problems = [text for ok, text in (
        (path.startswith("kernels/"), f"the CPU tier ran on '{path}', not the native kernels"),
        (cuda["relative_error_vs_fp32"] <= ERROR_FACTOR * cpu["relative_error_vs_fp32"] + 1e-3,
         f"CUDA's error against fp32 is more than {ERROR_FACTOR:g} times the CPU device's"),
        (cuda["argmax_agreement_vs_fp32"] >= cpu["argmax_agreement_vs_fp32"] - AGREEMENT_SLACK,
         "CUDA agrees with fp32's most likely tokens less often than the CPU device does"),
    ) if not ok]
    return {"status": "fail" if problems else "pass", **({"problems": problems} if problems else {}), **result}


def cpu_tier_path(llm) -> str:
    """Which code computed the CPU tier ("kernels/<isa>", "torch", ...): bf16 must reach the native kernels."""
    tier = next(iter(llm.hybrid.blocks.values())).cpu_tier
    return str(getattr(tier, "path", type(tier).__name__))


def mixed_prompts(vocab: int, long: int | None = None) -> list[list[int]]:
    """8 prompts of different lengths (4 to 60 tokens), the last one `long` tokens if given."""
    prompts = [p[: 4 + 8 * i] for i, p in enumerate(token_prompts(8, 60, vocab, seed=3))]
    if long:
        prompts[-1] = token_prompts(1, long, vocab, seed=4)[0]
    return prompts


def check_greedy_concurrency(ctx: CheckContext) -> dict:
    ckpt = checkpoint(ctx, "small")
    params = SamplingParams(max_tokens=8 if ctx.quick else 16, ignore_eos=True)
    spec, vocab = model_shape(ckpt)
    mask, prompts = uniform_mask(spec, 0.5), mixed_prompts(vocab)
    result, ok = {}, True
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        with LLM(ckpt, gpu_device=ctx.device, dtype=dtype, placement=mask, max_running=8, progress=False) as llm:
            together = [o.token_ids for o in llm.generate(prompts, params)]
            alone = [llm.generate([p], params)[0].token_ids for p in prompts]
        differ = {i: first_difference(a, b) for i, (a, b) in enumerate(zip(together, alone)) if a != b}
        result[name] = {"sequences": len(prompts), "equal": len(prompts) - len(differ),
                        "first_difference_by_sequence": differ}
        if name == "fp32":
            ok = not differ  # bf16 may round differently in a batch of another size: reported, not judged
    return {"status": "pass" if ok else "fail", "device": ctx.device, "judged": "fp32", **result}


def check_dynamic_vs_static(ctx: CheckContext) -> dict:
    ckpt = checkpoint(ctx, "small")
    params = SamplingParams(max_tokens=8 if ctx.quick else 16, ignore_eos=True)
    threshold = 64
    spec, vocab = model_shape(ckpt)
    mask, prompts = uniform_mask(spec, 0.25), mixed_prompts(vocab, long=4 * threshold)
    with LLM(ckpt, gpu_device=ctx.device, dtype=torch.float32, placement=mask, max_running=8, progress=False) as llm:
        before = memory_allocated(ctx)
        static = [o.token_ids for o in llm.generate(prompts, params)]
        static_growth = peak_growth(ctx, before)
    policies = {
        "adaptive": DynamicPlacementConfig(policy="adaptive", adaptive=AdaptiveSettings(
            half_life_tokens=8, replan_every=1, margin=0.0, max_swaps_in_flight=2)),
        "kt-dynamic": DynamicPlacementConfig(policy="kt-dynamic", prefill_threshold=threshold),
    }
    result, ok = {"device": ctx.device}, True
    for name, dynamic in policies.items():
        with LLM(ckpt, gpu_device=ctx.device, dtype=torch.float32, placement=mask, max_running=8, dynamic=dynamic,
                 progress=False) as llm:
            before = memory_allocated(ctx)
            outputs = [o.token_ids for o in llm.generate(prompts, params)]
            llm.placement_manager.drain()
            swaps = llm.hybrid.swap_stats.swaps
            row = {"swaps_landed": swaps, "placement_changed": not torch.equal(llm.placement, mask),
                   "equal_sequences": sum(a == b for a, b in zip(outputs, static)), "sequences": len(prompts),
                   "first_difference_by_sequence": {i: first_difference(a, b) for i, (a, b)
                                                    in enumerate(zip(outputs, static)) if a != b}}
            if ctx.cuda:  # GPU memory the swaps took beyond what serving the same prompts statically took
                per_expert = llm.hybrid.spec.bytes_per_expert(llm.hybrid.expert_dtype)
                row["peak_growth_beyond_static_in_experts"] = (peak_growth(ctx, before) - static_growth) / per_expert
        result[name] = row
        ok &= swaps > 0 and row["equal_sequences"] == len(prompts)
    return {"status": "pass" if ok else "fail", **result}


def memory_allocated(ctx: CheckContext) -> int:
    """Allocated GPU bytes now, the peak counter reset (0 without CUDA)."""
    if not ctx.cuda:
        return 0
    torch.cuda.synchronize(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    return torch.cuda.memory_allocated(ctx.device)


def peak_growth(ctx: CheckContext, before: int) -> int:
    return torch.cuda.max_memory_allocated(ctx.device) - before if ctx.cuda else 0
