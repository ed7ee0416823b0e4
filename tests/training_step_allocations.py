"""Run in a child process by tests/test_training_memory.py, with tests/alloc_tracker.c preloaded: one LoRA training
step (forward, backward, AdamW step) of a tiny Qwen3-MoE model whose experts are each larger than anything else a
step allocates, and the heap allocations the step made. Prints one JSON line:

  {"expert_bytes": smallest bytes one expert takes on a tier,
   "<case>": {"big": sizes of the step's allocations >= expert_bytes, "peak": most bytes held at once}}

Cases: "cpu_tier" (every expert on the native CPU tier, bf16, the C++ kernels), "both_tiers" (half of them on the
GPU tier, the CPU device here), "copying_backward" (cpu_tier with the backward made to take the tier's dequantised
copy of each expert, as a tier without kernels does: what the test must catch).

Usage: python -m training_step_allocations MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager, nullcontext

import torch
from allocation_tracking import Tracker
from conftest import make_mask, save_tiny
from training_reference import lora_config

from tiermoe.arch import detect, load_config
from tiermoe.config import CPUConfig
from tiermoe.experts.expert_matmuls import TorchMatmuls
from tiermoe.layers import routed_autograd
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.lora import apply_lora

# D=64, I=1024: an expert is 393 KB in bf16 (786 KB fp32 on the GPU tier), while a step's largest other buffers are
# a few [tokens, 2I] intermediates (16 tokens: 128 KB) and the LoRA factors' gradients (rank 1: [E, 2I, 2] fp32 is
# 64 KB). At larger ranks those gradients and AdamW's moments (adapter state, [E, ...] per layer) would pass an
# expert's size without copying one: rank 1 keeps the expert's size the one line nothing else crosses.
SIZES = {"moe_intermediate_size": 1024}
TOKENS = 16


def _step(model, optimizer, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@contextmanager
def _copying_backward():
    """The backward takes `tier.get(e)` (a dequantised fp32 copy of the expert) for its products."""
    real = routed_autograd.matmuls_of
    routed_autograd.matmuls_of = lambda tier, e, dtype: TorchMatmuls(tier.get(e), dtype)
    try:
        yield
    finally:
        routed_autograd.matmuls_of = real


def measure(path, tracker: Tracker) -> dict:
    spec = detect(load_config(path))
    ids = torch.randint(3, 100, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    found, sizes = {}, []
    for kind, cases in (("all_cpu", ("cpu_tier", "copying_backward")), ("random_half", ("both_tiers",))):
        hybrid = load_hybrid_model(path, make_mask(kind, spec), gpu_device="cpu", dtype=torch.float32,
                                   cpu=CPUConfig(expert_dtype="bf16"), progress=False, trainable=True)
        with hybrid:
            sizes += [t.nbytes // len(t) for b in hybrid.blocks.values() for t in (b.cpu_tier, b.gpu_tier) if len(t)]
            assert all(b.cpu_tier.path.startswith("kernels/") for b in hybrid.blocks.values() if len(b.cpu_tier))
            model = apply_lora(hybrid, lora_config(rank=1, alpha=2.0))
            model.train()
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            _step(model, optimizer, ids)  # AdamW makes its state and every lazy buffer is made on the first step
            for case in cases:
                copying = _copying_backward() if case == "copying_backward" else nullcontext()
                with copying, tracker.span(min(sizes)) as span:
                    _step(model, optimizer, ids)
                found[case] = {"big": span.big, "peak": span.peak}
    return {"expert_bytes": min(sizes), **found}


if __name__ == "__main__":
    torch.set_num_threads(1)
    model_dir = save_tiny("qwen3_moe", sys.argv[1], sizes=SIZES)
    print(json.dumps(measure(model_dir, Tracker())))
