"""The GPU check's serving, layerwise-prefill, FP8 and cost-model checks.

Each takes the CheckContext and returns a dict: status pass / fail / info / skipped (with a reason), and its
figures. Without CUDA (a rehearsal) they run with the GPU tier on the CPU device and say so.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from functools import partial

import torch

from tiermoe.analysis.device_profile import best_time, measure_profile, synchronizer
from tiermoe.analysis.gpu_check.models import (
    EXACT_TOLERANCE,
    checkpoint,
    logits,
    model_shape,
    rel_err,
    token_prompts,
    uniform_mask,
)
from tiermoe.analysis.gpu_check.plan import CheckContext
from tiermoe.analysis.placement_bench import (
    THIS_CPU,
    PlacementBenchConfig,
    run_placement_bench,
)
from tiermoe.analysis.placement_live import measure_configuration
from tiermoe.analysis.placement_workload import Workload, WorkloadSpec
from tiermoe.arch import detect, load_config
from tiermoe.config import DynamicPlacementConfig
from tiermoe.engine.llm import LLM
from tiermoe.experts.copier import AsyncCopier
from tiermoe.model.loader import load_hybrid_model
from tiermoe.placement.budget import GIB
from tiermoe.placement.profiles import save_profile
from tiermoe.testing.fp8_write import write_fp8_checkpoint

MIN_CHUNKS = 3  # layerwise prefill must really stream: at least this many chunks through its two buffers


def token_workload(name: str, num: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> Workload:
    """Random token-id requests of varied lengths (make-model checkpoints have no tokenizer)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = tuple(tuple(torch.randint(3, vocab, (max(1, prompt_len // 2 + i * prompt_len // (2 * num)),),
                                        generator=gen).tolist()) for i in range(num))
    lens = tuple(max(1, output_len // 2 + (i * output_len) // (2 * num)) for i in range(num))
    return Workload(name, prompts, lens)


def workloads(ctx: CheckContext, vocab: int) -> tuple[Workload, Workload]:
    n, plen, olen = (8, 24, 8) if ctx.quick else (24, 128, 48)
    return (token_workload("calibration", n, plen, olen, vocab, 1), token_workload("held-out", n, plen, olen, vocab, 2))


def check_serving_by_ratio(ctx: CheckContext) -> dict:
    ckpt = checkpoint(ctx, "small")
    ratios = (0.0, 0.5, 1.0) if ctx.quick else (0.0, 0.25, 0.5, 0.75, 1.0)
    concurrency = 4 if ctx.quick else 8
    workload = workloads(ctx, model_shape(ckpt)[1])[1]
    rows = {}
    with LLM(ckpt, gpu_device=ctx.device, progress=False) as llm:
        measure_configuration(llm, workload, "uniform", ratios[0], None, concurrency, 512, None)  # warm-up
        for ratio in ratios:
            timing, traffic = measure_configuration(llm, workload, "uniform", ratio, None, concurrency, 512, None)
            rows[f"{ratio:g}"] = {"output_tokens_per_s": timing.output_tokens_per_s,
                                  "total_tokens_per_s": timing.total_tokens_per_s,
                                  "ttft_mean_ms": 1e3 * timing.ttft_summary()["mean"],
                                  "hit_rate": traffic["gpu_pairs"] / max(1, traffic["pairs"])}
    return {"status": "info", "device": ctx.device, "workload": workload.describe(), "concurrency": concurrency,
            "by_ratio": rows}


def check_layerwise_prefill(ctx: CheckContext) -> dict:
    """fp32 through a buffer small enough for >= MIN_CHUNKS chunks in every layer: exact; then bf16 prefill time
    with and without the layerwise path. The buffer is sized from the routing the reference run saw (routing does
    not depend on placement): random weights route a prompt to a few experts only."""
    ckpt = checkpoint(ctx, "small")
    spec, vocab = model_shape(ckpt)
    mask = uniform_mask(spec, 0.25)
    threshold, length = 32, 64 if ctx.quick else 256
    ids = torch.tensor(token_prompts(1, length, vocab, seed=7))
    with LLM(ckpt, gpu_device="cpu", dtype=torch.float32, progress=False) as ref_llm:
        with routed_experts(ref_llm.hybrid) as routed:
            ref = logits(ref_llm, ids)
    fewest = min(int((~mask[layer][sorted(experts)]).sum()) for layer, experts in routed.items())
    chunk = max(1, fewest // MIN_CHUNKS)  # experts per buffer: every layer then streams >= MIN_CHUNKS chunks
    per_expert = spec.bytes_per_expert(torch.float32)
    buffer_gb = (2 * chunk * per_expert + per_expert // 2) / GIB
    dynamic = DynamicPlacementConfig(prefill_threshold=threshold, prefill_buffer_gb=buffer_gb)
    with LLM(ckpt, gpu_device=ctx.device, dtype=torch.float32, placement=mask, dynamic=dynamic,
             progress=False) as llm:
        out = logits(llm, ids)
        streamer = next(iter(llm.hybrid.blocks.values())).prefill_streamer
        batches = streamer.batches
    chunks = {layer: math.ceil(int((~mask[layer][sorted(experts)]).sum()) / streamer.chunk)
              for layer, experts in routed.items()}
    err = rel_err(out, ref)
    result = {"device": ctx.device, "prompt_tokens": length, "threshold": threshold, "buffer_gb": buffer_gb,
              "experts_per_chunk": streamer.chunk, "chunks_by_layer": chunks, "streamed_batches": batches,
              "relative_error": err, "tolerance": EXACT_TOLERANCE}
    result["prefill_ms"] = prefill_times(ctx, ckpt, mask, vocab, threshold, buffer_gb)
    ok = batches == len(chunks) and min(chunks.values()) >= MIN_CHUNKS and err <= EXACT_TOLERANCE
    return {"status": "pass" if ok else "fail", **result}


@contextmanager
def routed_experts(hybrid):
    """Within the block: layer -> the experts its router picked (hooks on the routers)."""
    routed: dict[int, set[int]] = {}

    def hook(module, inputs, output, layer):
        routed.setdefault(layer, set()).update(output[2].flatten().tolist())

    handles = [block._modules[hybrid.spec.router_attr].register_forward_hook(partial(hook, layer=layer))
               for layer, block in hybrid.blocks.items()]
    try:
        yield routed
    finally:
        for handle in handles:
            handle.remove()


def prefill_times(ctx: CheckContext, ckpt, mask, vocab: int, threshold: int, buffer_gb: float) -> dict:
    """bf16 prefill of one long prompt: the CPU tier computing its experts, and the layerwise path (best of 2)."""
    ids = torch.tensor(token_prompts(1, 64 if ctx.quick else 512, vocab, seed=8))
    sync = synchronizer(ctx.device)
    times = {}
    for name, dynamic in (("cpu_tier", None), ("layerwise",
                                               DynamicPlacementConfig(prefill_threshold=threshold,
                                                                      prefill_buffer_gb=buffer_gb))):
        with LLM(ckpt, gpu_device=ctx.device, dtype=torch.bfloat16, placement=mask, dynamic=dynamic,
                 progress=False) as llm:
            times[name] = 1e3 * best_time(lambda: logits(llm, ids), sync, repeats=2)
    return times


def check_fp8_gpu_tier(ctx: CheckContext, token_counts=(1, 64)) -> dict:
    """An FP8 copy of the small checkpoint with every expert on the GPU tier, held as e4m3 codes and block
    scales: logits against the same checkpoint dequantised on the CPU, bytes per parameter, every expert of one
    layer moved to the CPU tier and back through the asynchronous copier keeping its codes, and what the
    per-call dequantisation costs against a bf16 GPU tier."""
    ckpt = checkpoint(ctx, "small")
    fp8 = write_fp8_checkpoint(ckpt, ckpt.parent / "fp8")
    ids = torch.tensor(token_prompts(1, 24, model_shape(ckpt)[1], seed=1))
    with load_hybrid_model(fp8, None, gpu_device="cpu", dtype=torch.float32, progress=False) as ref_model:
        ref = ref_model(input_ids=ids).logits.float()
        spec = ref_model.spec
    all_gpu = spec.moe_row_mask()[:, None].expand(spec.num_layers, spec.num_experts).clone()
    with load_hybrid_model(fp8, all_gpu, gpu_device=ctx.device, dtype=torch.float32, progress=False) as hybrid:
        error = rel_err(hybrid(input_ids=ids.to(ctx.device)).logits, ref)
        per_param = hybrid.tier_bytes().gpu_experts / (spec.total_routed_experts * spec.params_per_expert)
        block = hybrid.blocks[spec.moe_layers[0]]
        before = {e: [t.cpu() for t in block.gpu_tier.experts[e].tensors()] for e in range(spec.num_experts)}
        copier = AsyncCopier()
        try:
            for to_gpu in (False, True):
                for e in range(spec.num_experts):
                    block.finish_move(e, to_gpu, block.start_move(e, to_gpu, copier).result())
        finally:
            copier.close()
        codes_kept = all(torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)) for e, old in before.items()
                         for a, b in zip(old[::2], block.gpu_tier.experts[e].tensors()[::2]))
        error_after_moves = rel_err(hybrid(input_ids=ids.to(ctx.device)).logits, ref)
    times = _gpu_tier_times({"bf16": ckpt, "fp8": fp8}, all_gpu, ctx.device, token_counts)
    result = {"device": ctx.device, "relative_error": error, "relative_error_after_moves": error_after_moves,
              "gpu_expert_bytes_per_param": per_param, "codes_kept_through_moves": codes_kept,
              "gpu_tier_ms": times,
              "fp8_over_bf16_time": {t: times[f"fp8_{t}"] / times[f"bf16_{t}"] for t in token_counts},
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
                x = torch.randn(tokens, hybrid.spec.hidden_size, generator=torch.Generator().manual_seed(tokens))
                x = x.to(device, torch.bfloat16)
                _, weights, ids = getattr(block, hybrid.spec.router_attr)(x)
                times[f"{name}_{tokens}"] = 1e3 * best_time(partial(block.gpu_tier.forward, x, ids, weights), sync)
    return times


def check_cost_model_calibration(ctx: CheckContext) -> dict:
    """Measure this device's profile, then estimate (GPU tier on the CPU, this profile) vs measure (on the
    device). Without CUDA: the this-cpu validation."""
    ckpt = checkpoint(ctx, "small")
    spec = detect(load_config(ckpt))
    vocab = model_shape(ckpt)[1]
    # small: it runs last, and serves every configuration twice (estimated with the GPU tier on the CPU, measured)
    pair = tuple(token_workload(name, 8 if ctx.quick else 12, 24 if ctx.quick else 96, 8 if ctx.quick else 32, vocab,
                                seed) for name, seed in (("calibration", 1), ("held-out", 2)))
    bench = dict(workload=WorkloadSpec("token-ids"), model=ckpt, ratios=(0.5,), strategies=("uniform", "frequency"),
                 concurrency=4 if ctx.quick else 8, repeats=1, prefill_threshold=None, calibration_ratios=(0.0, 1.0),
                 validation_ratios=(0.5,), validation_strategies=("uniform",))

    def quiet(message):
        return None

    if not ctx.cuda:
        result = run_placement_bench(PlacementBenchConfig(gpu_profile=THIS_CPU, **bench), quiet, pair)
        return {"status": "info", "reason": "no CUDA: the this-cpu validation instead",
                "validation": result.validation, "host": result.calibration["host"],
                "cpu_backend": result.calibration["cpu_backend"], "this_cpu_profile": result.gpu_profile}
    start = time.perf_counter()
    profile = measure_profile(ctx.device, spec.hidden_size, spec.expert_intermediate_size, spec.dtype,
                              spec.total_routed_experts * spec.bytes_per_expert())
    path = save_profile(profile, f"{ctx.out_dir}/gpu_profile.json", measured_by="benchmarks/gpu_check.sh",
                        torch=torch.__version__)
    profile_s = time.perf_counter() - start
    estimated = run_placement_bench(PlacementBenchConfig(gpu_profile=str(path), gpu_device="cpu", **bench), quiet,
                                    pair)
    measured = run_placement_bench(PlacementBenchConfig(gpu_profile=str(path), gpu_device=ctx.device, **bench),
                                   quiet, pair)
    rows = []
    for cell in measured.cells:
        est = estimated.get(cell.strategy, cell.ratio)
        rows.append({"strategy": cell.strategy, "ratio": cell.ratio,
                     "measured_output_tokens_per_s": cell.output_tokens_per_s,
                     "estimated_output_tokens_per_s": est.output_tokens_per_s,
                     "relative_error": est.output_tokens_per_s / cell.output_tokens_per_s - 1,
                     "measured_hit_rate": cell.hit_rate, "estimated_hit_rate": est.hit_rate})
    return {"status": "info", "profile": profile.as_dict(), "profile_file": str(path), "profile_seconds": profile_s,
            "estimate_vs_measurement": rows, "host": estimated.calibration["host"],
            "cpu_backend": estimated.calibration["cpu_backend"]}
