"""Where the host waits for the GPU, and whether the two tiers really run at the same time.

host_syncs: one decode step of 8 sequences with torch.cuda.set_sync_debug_mode("warn"): every synchronising
CUDA call warns, and the warning is taken with the Python stack of the call, so each is counted once, at the
tiermoe line that caused it, and as inside a MoE block or not. A decode step should wait for the GPU about
once per MoE layer (the CPU tier's inputs); more is time the GPU sits idle.

deferred_decode: decode steps with deferred experts off and on (--kt-max-deferred-experts-per-token 2).

overlap_real_shapes: one MoE layer at Qwen3-30B-A3B's shapes, half its experts per tier, at several token
counts: the CPU tier alone, the GPU tier alone, and the hybrid layer. When the layer takes less than the sum,
the tiers overlapped.
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

import tiermoe
from tiermoe.analysis.device_profile import best_time, synchronizer
from tiermoe.analysis.gpu_check.models import (
    checkpoint,
    model_shape,
    token_prompts,
    uniform_mask,
    vocab_of,
)
from tiermoe.analysis.gpu_check.plan import CheckContext
from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams

PACKAGE = str(Path(tiermoe.__file__).parent)
# the MoE code: the block, its host round trip and the tiers (the rest of layers/ is attention and the step's
# metadata, whose uploads would read as false alarms here)
MOE_FILES = tuple(f"{PACKAGE}/{part}" for part in ("layers/hybrid_moe.py", "layers/host_ring.py",
                                                   "layers/host_copies.py", "layers/deferred_experts.py", "experts/"))
TARGET_SYNCS_PER_LAYER = 1


def decode_ready(llm, batch: int = 8, prompt_len: int = 16, seed: int = 5) -> list:
    """Add `batch` sequences and step until every one is decoding; returns them (the next step is decode)."""
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    seqs = [llm.engine.add(p, params) for p in token_prompts(batch, prompt_len, vocab_of(llm), seed)]
    while any(not s.output_ids for s in seqs):
        llm.engine.step()
    llm.engine.step()  # one decode step first: lazy set-up is not what is measured
    return seqs


def check_host_syncs(ctx: CheckContext) -> dict:
    ckpt = checkpoint(ctx, "small")
    with LLM(ckpt, gpu_device=ctx.device, dtype=torch.bfloat16, progress=False, max_running=8,
             placement=uniform_mask(model_shape(ckpt)[0], 0.5)) as llm:
        decode_ready(llm)
        if not ctx.cuda:
            llm.engine.step()
            return {"status": "skipped", "reason": "no CUDA (a decode step ran; nothing to count)"}
        syncs = count_syncs(llm.engine.step, torch.device(ctx.device))
        layers = len(llm.hybrid.blocks)
    in_moe = sum(1 for s in syncs if s["in_moe"])
    per_layer = in_moe / max(1, layers)
    sites = Counter(s["site"] for s in syncs)
    result = {"moe_layers": layers, "batch": 8, "syncs_in_step": len(syncs), "syncs_in_moe_blocks": in_moe,
              "syncs_per_moe_layer": per_layer, "target_per_moe_layer": TARGET_SYNCS_PER_LAYER,
              "by_site": dict(sites.most_common(25))}
    if per_layer <= TARGET_SYNCS_PER_LAYER:
        return {"status": "pass", **result}
    return {"status": "info", "reason": f"{per_layer:g} per MoE layer, above the target of "
                                        f"{TARGET_SYNCS_PER_LAYER}", **result}


def check_deferred_decode(ctx: CheckContext) -> dict:
    """Decode steps of 8 sequences, half the experts on each tier, with deferred experts off and at 2 of top-8:
    what deferring buys where the deferred job overlaps the next layer's GPU work (on the CPU it cannot)."""
    ckpt = checkpoint(ctx, "small")
    mask = uniform_mask(model_shape(ckpt)[0], 0.5)
    steps = 2 if ctx.quick else 12
    ms = {}
    for deferred in (0, 2):
        with LLM(ckpt, gpu_device=ctx.device, dtype=torch.bfloat16, progress=False, max_running=8, placement=mask,
                 cpu=CPUConfig(deferred_experts=deferred)) as llm:
            decode_ready(llm)
            sync = synchronizer(llm.hybrid.gpu_device)
            ms[deferred] = best_time(lambda: [llm.engine.step() for _ in range(steps)], sync, repeats=2) / steps * 1e3
    return {"status": "info", "device": ctx.device, "batch": 8, "ms_per_decode_step": {f"d={d}": v for d, v in
            ms.items()}, "speedup_at_d2": ms[0] / ms[2]}


def count_syncs(fn, device: torch.device) -> list[dict]:
    """Run `fn` with CUDA's sync debug mode on; one record per synchronising call: the innermost tiermoe line
    on its stack (`site`) and whether a MoE block's code is on it (`in_moe`)."""
    found = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if f.filename.startswith(PACKAGE)]
        site = f"{Path(ours[-1].filename).relative_to(Path(PACKAGE).parent)}:{ours[-1].lineno}" if ours else \
            f"{Path(filename).name}:{lineno}"
        found.append({"site": site, "in_moe": any(f.filename.startswith(MOE_FILES) for f in ours)})

    torch.cuda.synchronize(device)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def check_overlap_real_shapes(ctx: CheckContext) -> dict:
    ckpt = checkpoint(ctx, "real")
    token_counts = (1, 8) if ctx.quick else (1, 8, 64, 256)
    with LLM(ckpt, gpu_device=ctx.device, dtype=torch.bfloat16, progress=False,
             placement=uniform_mask(model_shape(ckpt)[0], 0.5)) as llm:
        spec = llm.hybrid.spec
        rows = {str(t): layer_times(llm, t) for t in token_counts}
    shape = {"hidden": spec.hidden_size, "expert_intermediate": spec.expert_intermediate_size,
             "experts": spec.num_experts, "top_k": spec.top_k, "gpu_experts": spec.num_experts // 2}
    if not ctx.cuda:
        return {"status": "info", "reason": "no CUDA: both tiers share the host's cores, no overlap expected",
                "shape": shape, "by_tokens": rows}
    # judged where the two tiers take the most similar time: there overlap shows most
    balanced = max(rows.values(), key=lambda r: min(r["cpu_tier_ms"], r["gpu_tier_ms"])
                   / max(r["cpu_tier_ms"], r["gpu_tier_ms"]))
    ok = balanced["hybrid_layer_ms"] < 0.95 * (balanced["cpu_tier_ms"] + balanced["gpu_tier_ms"])
    return {"status": "pass" if ok else "fail", "judged_at_tokens": balanced["tokens"], "shape": shape,
            "by_tokens": rows}


def layer_times(llm, tokens: int) -> dict:
    hybrid = llm.hybrid
    spec, device = hybrid.spec, hybrid.gpu_device
    block = next(iter(hybrid.blocks.values()))
    sync = synchronizer(device)
    with torch.inference_mode():
        x = torch.randn(tokens, spec.hidden_size, generator=torch.Generator().manual_seed(tokens))
        x = x.to(device, hybrid.expert_dtype)
        _, weights, ids = getattr(block, spec.router_attr)(x)
        on_gpu = block.assignment_E[ids] >= 0
        cpu_ids, gpu_ids = ids.masked_fill(on_gpu, -1), ids.masked_fill(~on_gpu, -1)
        x_cpu, cpu_ids_cpu, weights_cpu = x.cpu(), cpu_ids.cpu(), weights.cpu()

        def cpu_only():
            block.cpu_tier.submit(x_cpu, cpu_ids_cpu, weights_cpu)
            block.cpu_tier.sync()

        t_cpu = best_time(cpu_only, sync)
        t_gpu = best_time(lambda: block.gpu_tier.forward(x, gpu_ids, weights), sync)
        t_both = best_time(lambda: block.forward_tokens(x[None]), sync)
    hidden = max(0.0, t_cpu + t_gpu - t_both) / max(1e-12, min(t_cpu, t_gpu))
    return {"tokens": tokens, "cpu_tier_ms": 1e3 * t_cpu, "gpu_tier_ms": 1e3 * t_gpu, "hybrid_layer_ms": 1e3 * t_both,
            "overlap_of_shorter_tier": min(1.0, hidden)}
