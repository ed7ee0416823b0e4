"""Run in a child process by tests/test_training_memory.py, with tests/alloc_tracker.c preloaded: one LoRA training
step (forward, backward, AdamW step) of a tiny Qwen3-MoE model whose experts are each larger than anything else a
step allocates, and the heap allocations the step made. Prints one JSON line:

  {"matrix_bytes": the bytes of one expert's smallest weight matrix (a third of the expert: down, D x I) on the
                   tier that stores experts smallest,
   "<case>": {"big": the step's allocations >= matrix_bytes, "peak": most bytes held at once}}

Cases: "cpu_tier" (every expert on the native CPU tier, bf16, the C++ kernels), "both_tiers" (half of them on the
GPU tier, the CPU device here), and two that the test must catch: "dequantising_backward" (cpu_tier with the backward
made to take the tier's dequantised fp32 copy of each expert, as a tier without kernels does) and
"copying_backward" (cpu_tier with each transposed down product first copying the stored down matrix).
"context": the most bytes held during a forward + backward of the tiny Qwen3-MoE test model (conftest's, all on the
CPU tier, gradient checkpointing, the CPU tier in spans of SPAN_PROBE tokens) at each of CONTEXTS tokens, the
measure `tiermoe fit --train`'s per-token term is checked against.

Usage: python -m training_step_allocations OUT_DIR
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from allocation_tracking import Tracker
from conftest import make_mask, save_tiny
from training_reference import lora_config

from tiermoe.arch import detect, load_config
from tiermoe.config import CPUConfig
from tiermoe.experts.expert_matmuls import TorchMatmuls
from tiermoe.experts.kernel_matmuls import KernelMatmuls
from tiermoe.layers import routed_autograd
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.context_memory import SPAN_PROBE
from tiermoe.training.long_context import set_expert_chunk
from tiermoe.training.lora import apply_lora

# D=128, I=1024: an expert's down matrix is 256 KB in bf16 (the whole expert 768 KB; 1.5 MB fp32 on the GPU tier),
# while a step's largest other buffers are a few [tokens, 2I] intermediates (16 tokens: 128 KB) and the LoRA
# factors' gradients (rank 1: [E, 2I, 2] fp32 is 128 KB). At larger ranks those gradients and AdamW's moments (adapter
# state, [E, ...] per layer) would pass a matrix's size without copying one: rank 1 keeps one expert matrix the line
# nothing else crosses.
SIZES = {"hidden_size": 128, "moe_intermediate_size": 1024}
TOKENS = 16
CONTEXTS = (1024, 2048)


def _step(model, optimizer, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@contextmanager
def _replaced(owner, name: str, value):
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _dequantising_backward():
    """The products take `tier.get(e)` (a dequantised fp32 copy of the expert)."""
    return _replaced(routed_autograd, "matmuls_of", lambda tier, e, dtype: TorchMatmuls(tier.get(e), dtype))


def _copying_backward():
    """Each transposed down product first copies the down matrix as the tier stores it."""
    real = KernelMatmuls.down_t

    def down_t(self, g_ND):
        held = self.w_down.q.codes.clone()
        return real(self, g_ND) + 0 * held.sum()

    return _replaced(KernelMatmuls, "down_t", down_t)


INJECTED = {"dequantising_backward": _dequantising_backward, "copying_backward": _copying_backward}


def measure(path, tracker: Tracker) -> dict:
    spec = detect(load_config(path))
    ids = torch.randint(3, 100, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    found, sizes = {}, []
    for kind, cases in (("all_cpu", ("cpu_tier", *INJECTED)), ("random_half", ("both_tiers",))):
        hybrid = load_hybrid_model(path, make_mask(kind, spec), gpu_device="cpu", dtype=torch.float32,
                                   cpu=CPUConfig(expert_dtype="bf16"), progress=False, trainable=True)
        with hybrid:
            sizes += [t.nbytes // len(t) // 3 for b in hybrid.blocks.values() for t in (b.cpu_tier, b.gpu_tier)
                      if len(t)]
            assert all(b.cpu_tier.path.startswith("kernels/") for b in hybrid.blocks.values() if len(b.cpu_tier))
            model = apply_lora(hybrid, lora_config(rank=1, alpha=2.0))
            model.train()
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            _step(model, optimizer, ids)  # AdamW makes its state and every lazy buffer is made on the first step
            for case in cases:
                with INJECTED.get(case, nullcontext)(), tracker.span(min(sizes)) as span:
                    _step(model, optimizer, ids)
                found[case] = {"big": span.big, "peak": span.peak}
    return {"matrix_bytes": min(sizes), **found}


def context_peaks(path, tracker: Tracker) -> list[int]:
    peaks = []
    with load_hybrid_model(path, None, gpu_device="cpu", dtype=torch.float32, progress=False,
                           trainable=True) as hybrid:
        model = apply_lora(hybrid, lora_config(rank=4, alpha=8.0))
        model.gradient_checkpointing_enable()
        model.train()
        set_expert_chunk(hybrid, SPAN_PROBE)
        for tokens in (CONTEXTS[0], *CONTEXTS):  # the first step makes the model's lazy buffers: not counted
            ids = torch.randint(0, hybrid.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
            model.zero_grad(set_to_none=True)
            with tracker.span(1 << 62) as span:
                model(input_ids=ids, labels=ids).loss.backward()
            peaks.append(span.peak)
    return peaks[1:]


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    tracker = Tracker()
    found = measure(save_tiny("qwen3_moe", out / "large-experts", sizes=SIZES), tracker)
    found["context"] = {"tokens": CONTEXTS, "peaks": context_peaks(save_tiny("qwen3_moe", out / "tiny"), tracker)}
    print(json.dumps(found))
