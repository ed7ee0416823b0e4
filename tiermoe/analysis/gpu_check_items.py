"""The individual checks of `benchmarks/gpu_check.sh` (run by tiermoe.analysis.gpu_check).

Each takes a checkpoint or a loaded model and the device, and returns a dict: status pass / fail / info /
skipped (with a reason), and its figures. CUDA-only ones say "skipped: no CUDA" on a CPU-only machine; the rest
then run with the GPU tier on the CPU device.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch

from tiermoe.analysis.device_profile import best_time, measure_profile, synchronizer
from tiermoe.analysis.placement_bench import THIS_CPU, PlacementBenchConfig, run_placement_bench
from tiermoe.analysis.placement_live import measure_configuration
from tiermoe.analysis.placement_traffic import strategy_mask
from tiermoe.analysis.placement_workload import Workload, WorkloadSpec
from tiermoe.arch import detect, load_config
from tiermoe.config import DynamicPlacementConfig, PlacementConfig
from tiermoe.engine.llm import LLM
from tiermoe.experts.copier import AsyncCopier
from tiermoe.model.loader import load_hybrid_model
from tiermoe.model.plan_source import plan_from_config
from tiermoe.placement.profiles import save_profile
from tiermoe.testing.fp8_write import write_fp8_checkpoint

EXACT_TOLERANCE = 1e-3  # max |a - ref| / max |ref| of fp32 logits


def token_workload(name: str, num: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> Workload:
    """Random token-id requests (make-model checkpoints have no tokenizer)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = tuple(tuple(torch.randint(3, vocab, (max(1, prompt_len // 2 + i * prompt_len // (2 * num)),),
                                        generator=gen).tolist()) for i in range(num))
    lens = tuple(max(1, output_len // 2 + (i * output_len) // (2 * num)) for i in range(num))
    return Workload(name, prompts, lens)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float().cpu() - ref.float().cpu()).abs().max() / ref.float().abs().max())


def uniform_mask(spec, ratio: float) -> torch.Tensor:
    return strategy_mask("uniform", spec.moe_row_mask(), spec.num_experts, ratio, None)


def _logits(llm, ids: torch.Tensor) -> torch.Tensor:
    return llm.hybrid(input_ids=ids.to(llm.hybrid.gpu_device)).logits.float().cpu()


def check_exactness(ckpt: Path, device: str, ratios) -> dict:
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(1))
    with LLM(ckpt, gpu_device="cpu", dtype=torch.float32, progress=False) as ref_llm:
        ref = _logits(ref_llm, ids)
    errors = {}
    for ratio in ratios:
        with LLM(ckpt, gpu_device=device, dtype=torch.float32, progress=False,
                 placement=uniform_mask(ref_llm.hybrid.spec, ratio)) as llm:
            errors[f"{ratio:g}"] = rel_err(_logits(llm, ids), ref)
    worst = max(errors.values())
    return {"status": "pass" if worst <= EXACT_TOLERANCE else "fail", "device": device,
            "relative_error_by_ratio": errors, "tolerance": EXACT_TOLERANCE}


def check_overlap(llm, tokens: int) -> dict:
    """One MoE layer, half its experts per tier: both tiers together against each alone."""
    hybrid = llm.hybrid
    spec = hybrid.spec
    device = hybrid.gpu_device
    hybrid.apply_mask(uniform_mask(spec, 0.5))
    block = next(iter(hybrid.blocks.values()))
    sync = synchronizer(device)
    with torch.inference_mode():
        x = torch.randn(tokens, spec.hidden_size, device=device).to(hybrid.expert_dtype)
        _, weights, ids = getattr(block, spec.router_attr)(x)
        on_gpu = block.assignment_E[ids] >= 0
        cpu_ids, gpu_ids = ids.masked_fill(on_gpu, -1), ids.masked_fill(~on_gpu, -1)

        def cpu_only():
            block.cpu_tier.submit(x.cpu(), cpu_ids.cpu(), weights.cpu())
            block.cpu_tier.sync()

        t_cpu = best_time(cpu_only, sync)
        t_gpu = best_time(lambda: block.gpu_tier.forward(x, gpu_ids, weights), sync)
        t_both = best_time(lambda: block.forward_tokens(x[None]), sync)
    hidden = max(0.0, t_cpu + t_gpu - t_both) / max(1e-12, min(t_cpu, t_gpu))
    result = {"tokens": tokens, "cpu_tier_ms": 1e3 * t_cpu, "gpu_tier_ms": 1e3 * t_gpu, "hybrid_layer_ms": 1e3 * t_both,
              "overlap_of_shorter_tier": min(1.0, hidden)}
    if device.type != "cuda":
        return {"status": "info", "reason": "GPU tier on the CPU: both tiers share the cores, no overlap expected",
                **result}
    return {"status": "pass" if t_both < 0.95 * (t_cpu + t_gpu) else "fail", **result}


def check_pinned_copies(llm) -> dict:
    hybrid = llm.hybrid
    device = hybrid.gpu_device
    if device.type != "cuda":
        return {"status": "skipped", "reason": "no CUDA"}
    hybrid.apply_mask(uniform_mask(hybrid.spec, 0.0))
    experts = [(block, e) for block in hybrid.blocks.values() for e in range(hybrid.spec.num_experts)
               if e in block.cpu_tier]
    pinned = all(t.is_pinned() for block, e in experts for t in block.cpu_tier.get(e).tensors())
    batch = [block.cpu_tier.get(e) for block, e in experts[:32]]
    nbytes = sum(w.nbytes for w in batch)
    copier = AsyncCopier()
    try:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        tickets = [copier.start(w, device) for w in batch]
        started = time.perf_counter() - start
        landed_at_start = sum(t.landed() for t in tickets)
        for t in tickets:
            t.result()
        total = time.perf_counter() - start
    finally:
        copier.close()
    pageable = [w.to("cpu") for w in batch]  # fresh, unpinned host copies

    def copy_pageable():
        for w in pageable:
            w.to(device)

    t_pageable = best_time(copy_pageable, lambda: torch.cuda.synchronize(device), 3)
    ok = pinned and started < total
    return {"status": "pass" if ok else "fail", "cpu_tier_pinned": pinned, "experts_copied": len(batch),
            "start_ms": 1e3 * started, "landed_ms": 1e3 * total, "landed_when_start_returned": landed_at_start,
            "pinned_async_gb_s": nbytes / total / 1e9, "pageable_gb_s": nbytes / t_pageable / 1e9}


def check_auto_budget(ckpt: Path, device: str) -> dict:
    if not device.startswith("cuda"):
        return {"status": "skipped", "reason": "no CUDA (--gpu-memory-gb auto reads free CUDA memory)"}
    config = PlacementConfig(strategy="uniform", gpu_memory_gb="auto")
    plan = plan_from_config(config, ckpt, device)
    with LLM(ckpt, gpu_device=device, placement=plan, progress=False) as llm:
        on_gpu = int(llm.placement.sum())
        gpu_bytes = llm.hybrid.tier_bytes().gpu_experts
    free, total = torch.cuda.mem_get_info(torch.device(device))
    ok = on_gpu == plan.budget["total_gpu_experts"] and on_gpu > 0
    return {"status": "pass" if ok else "fail", "gpu_experts": on_gpu, "planned": plan.budget,
            "gpu_expert_bytes": gpu_bytes, "free_after_gib": free / 2**30, "total_gib": total / 2**30}


def check_layerwise_prefill(ckpt: Path, device: str, threshold: int) -> dict:
    ids = torch.randint(3, 200, (1, 2 * threshold), generator=torch.Generator().manual_seed(2))
    with LLM(ckpt, gpu_device="cpu", dtype=torch.float32, progress=False) as ref_llm:
        ref = _logits(ref_llm, ids)
        spec = ref_llm.hybrid.spec
    with LLM(ckpt, gpu_device=device, dtype=torch.float32, progress=False, placement=uniform_mask(spec, 0.25),
             dynamic=DynamicPlacementConfig(prefill_threshold=threshold)) as llm:
        out = _logits(llm, ids)
        streamer = next(iter(llm.hybrid.blocks.values())).prefill_streamer
        batches = streamer.batches
    err = rel_err(out, ref)
    ok = batches > 0 and err <= EXACT_TOLERANCE
    return {"status": "pass" if ok else "fail", "device": device, "threshold": threshold, "prompt_tokens": ids.shape[1],
            "streamed_batches": batches, "relative_error": err}


def check_serving(llm, workload: Workload, ratios, concurrency: int) -> dict:
    rows = {}
    measure_configuration(llm, workload, "uniform", ratios[0], None, concurrency, 512, None)  # warm-up
    for ratio in ratios:
        timing, traffic = measure_configuration(llm, workload, "uniform", ratio, None, concurrency, 512, None)
        rows[f"{ratio:g}"] = {"output_tokens_per_s": timing.output_tokens_per_s,
                              "total_tokens_per_s": timing.total_tokens_per_s,
                              "ttft_mean_ms": 1e3 * timing.ttft_summary()["mean"],
                              "hit_rate": traffic["gpu_pairs"] / max(1, traffic["pairs"])}
    return {"status": "info", "device": str(llm.hybrid.gpu_device), "workload": workload.describe(),
            "concurrency": concurrency, "by_ratio": rows}


def check_calibration(ckpt: Path, device: str, out_dir: Path, workloads, ratios, quick: bool) -> dict:
    """Measure this device's profile, then estimate (GPU tier on the CPU, this profile) vs measure (on the device)."""
    spec = detect(load_config(ckpt))
    bench = dict(workload=WorkloadSpec("token-ids"), model=ckpt, ratios=tuple(ratios),
                 strategies=("uniform", "frequency"), concurrency=4 if quick else 8, repeats=1,
                 prefill_threshold=None, calibration_ratios=(0.0, 1.0), validation_ratios=(0.5,) if quick else
                 (0.25, 0.5), validation_strategies=("uniform",))
    quiet = lambda message: None
    if not device.startswith("cuda"):
        result = run_placement_bench(PlacementBenchConfig(gpu_profile=THIS_CPU, **bench), quiet, workloads)
        return {"status": "info", "reason": "no CUDA: the this-cpu validation instead",
                "validation": result.validation, "host": result.calibration["host"],
                "cpu_backend": result.calibration["cpu_backend"], "this_cpu_profile": result.gpu_profile}
    profile = measure_profile(device, spec.hidden_size, spec.expert_intermediate_size, spec.dtype,
                              spec.total_routed_experts * spec.bytes_per_expert())
    path = save_profile(profile, out_dir / "gpu_profile.json", measured_by="benchmarks/gpu_check.sh",
                        torch=torch.__version__)
    estimated = run_placement_bench(PlacementBenchConfig(gpu_profile=str(path), gpu_device="cpu", **bench), quiet,
                                    workloads)
    measured = run_placement_bench(PlacementBenchConfig(gpu_profile=str(path), gpu_device=device, **bench), quiet,
                                   workloads)
    rows = []
    for cell in measured.cells:
        est = estimated.get(cell.strategy, cell.ratio)
        rows.append({"strategy": cell.strategy, "ratio": cell.ratio,
                     "measured_output_tokens_per_s": cell.output_tokens_per_s,
                     "estimated_output_tokens_per_s": est.output_tokens_per_s,
                     "relative_error": est.output_tokens_per_s / cell.output_tokens_per_s - 1,
                     "measured_hit_rate": cell.hit_rate, "estimated_hit_rate": est.hit_rate})
    return {"status": "info", "profile": profile.as_dict(), "profile_file": str(path),
            "estimate_vs_measurement": rows, "host": estimated.calibration["host"],
            "cpu_backend": estimated.calibration["cpu_backend"]}


def check_fp8_gpu_tier(ckpt: Path, device: str, work_dir: Path, token_counts=(1, 64)) -> dict:
    """An FP8 copy of `ckpt` with every expert on the GPU tier, held as e4m3 codes and block scales: logits
    against the same checkpoint dequantised on the CPU, bytes per parameter, every expert of one layer moved to
    the CPU tier and back through the asynchronous copier (on CUDA: a side stream reading a transient dequantised
    copy) keeping its codes, and what the per-call dequantisation costs against a bf16 GPU tier."""

    fp8 = write_fp8_checkpoint(ckpt, work_dir / "fp8")
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(1))
    with load_hybrid_model(fp8, None, gpu_device="cpu", dtype=torch.float32, progress=False) as ref_model:
        ref = ref_model(input_ids=ids).logits.float()
        spec = ref_model.spec
    all_gpu = spec.moe_row_mask()[:, None].expand(spec.num_layers, spec.num_experts).clone()
    with load_hybrid_model(fp8, all_gpu, gpu_device=device, dtype=torch.float32, progress=False) as hybrid:
        error = rel_err(hybrid(input_ids=ids.to(device)).logits, ref)
        per_param = hybrid.tier_bytes().gpu_experts / (spec.total_routed_experts * spec.params_per_expert)
        block = hybrid.blocks[spec.moe_layers[0]]
        before = {e: [t.cpu() for t in block.gpu_tier.experts[e].tensors()] for e in range(spec.num_experts)}
        copier = AsyncCopier()
        for to_gpu in (False, True):
            for e in range(spec.num_experts):
                block.finish_move(e, to_gpu, block.start_move(e, to_gpu, copier).result())
        copier.close()
        codes_kept = all(torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
                         for e, old in before.items() for a, b in zip(old[::2], block.gpu_tier.experts[e].tensors()[::2]))
        error_after_moves = rel_err(hybrid(input_ids=ids.to(device)).logits, ref)
    times = _gpu_tier_times({"bf16": ckpt, "fp8": fp8}, all_gpu, device, token_counts)
    result = {"device": device, "relative_error": error, "relative_error_after_moves": error_after_moves,
              "gpu_expert_bytes_per_param": per_param, "codes_kept_through_moves": codes_kept,
              "gpu_tier_ms": times, "fp8_over_bf16_time": {t: times[f"fp8_{t}"] / times[f"bf16_{t}"]
                                                            for t in token_counts},
              "tolerance": EXACT_TOLERANCE}
    ok = max(error, error_after_moves) <= EXACT_TOLERANCE and codes_kept and per_param < 1.05
    return {"status": "pass" if ok else "fail", **result}


def _gpu_tier_times(checkpoints: dict, mask, device: str, token_counts) -> dict:
    """ms of one layer's GPU tier (bf16 compute, all its experts there) per checkpoint and token count."""
    sync = synchronizer(device)
    times = {}
    for name, path in checkpoints.items():
        with load_hybrid_model(path, mask, gpu_device=device, dtype=torch.bfloat16, progress=False) as hybrid, \
                torch.inference_mode():
            block = hybrid.blocks[hybrid.spec.moe_layers[0]]
            for tokens in token_counts:
                x = torch.randn(tokens, hybrid.spec.hidden_size, device=device, dtype=torch.bfloat16,
                                generator=torch.Generator(device).manual_seed(tokens))
                _, weights, ids = getattr(block, hybrid.spec.router_attr)(x)
                times[f"{name}_{tokens}"] = 1e3 * best_time(partial(block.gpu_tier.forward, x, ids, weights), sync)
    return times
