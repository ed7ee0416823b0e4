"""An error in a MoE block's GPU part while its CPU part computes (a CUDA OOM, a device error) must surface as
itself, and leave the block usable: the next forward of the same layer runs and is exact.

The error is raised by a dispatch mode entered only inside the GPU part (the GPU tier, or the shared experts),
on the CPU device path, so it lands exactly between the CPU tier's submit and sync.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import make_mask
from torch.utils._python_dispatch import TorchDispatchMode

from tiermoe.arch import detect, load_config
from tiermoe.model.loader import load_hybrid_model


class RaiseOnFirstOp(TorchDispatchMode):
    """Raises `error` at the first aten op dispatched while it is active (like a kernel launch that fails)."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raise self.error


def fail_once_inside(module_or_tier, method: str, error: BaseException):
    """Make the next call of `module_or_tier.method` fail with `error` at its first op; later calls run normally."""
    original = getattr(module_or_tier, method)
    armed = [True]

    def failing(*args, **kwargs):
        if armed[0]:
            armed[0] = False
            with RaiseOnFirstOp(error):
                return original(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(module_or_tier, method, failing)


def slow_cpu_tier(block, log: list):
    """The CPU tier's job takes a while, and logs its start and end: the error must not leave it running."""
    compute = block.cpu_tier._compute

    def slow(x, ids, w):
        log.append("start")
        time.sleep(0.05)
        out = compute(x, ids, w)
        log.append("end")
        return out

    block.cpu_tier._compute = slow


def hidden(spec, tokens: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, tokens, spec.hidden_size, generator=torch.Generator().manual_seed(seed))


def oom() -> BaseException:
    return torch.OutOfMemoryError("CUDA out of memory (simulated inside the GPU part)")


@pytest.mark.parametrize("arch, part", [("deepseek_v3", "gpu_tier"), ("deepseek_v3", "shared_experts"),
                                        ("qwen2_moe", "shared_expert")])
def test_gpu_part_error_surfaces_and_the_next_forward_is_exact(arch, part, tiny_dir):
    path = tiny_dir(arch)
    spec = detect(load_config(path))
    with load_hybrid_model(path, make_mask("random_half", spec), dtype=torch.float32, progress=False) as hybrid:
        layer, block = next((i, b) for i, b in hybrid.blocks.items() if len(b.cpu_tier) and len(b.gpu_tier))
        x = hidden(spec)
        with torch.inference_mode():
            ref = block(x)
        jobs = []
        slow_cpu_tier(block, jobs)
        target = block.gpu_tier if part == "gpu_tier" else block._modules[part]
        fail_once_inside(target, "forward", oom())
        with torch.inference_mode():
            with pytest.raises(torch.OutOfMemoryError, match="simulated inside the GPU part"):
                block(x)
            assert jobs in ([], ["start", "end"])  # the CPU job was cancelled or waited for, not left running
            again = block(x)
        assert torch.equal(again, ref), f"layer {layer}: the forward after the error differs"


def test_interrupt_between_submit_and_sync_leaves_the_tier_free(tiny_dir):
    """Not only Exceptions: a KeyboardInterrupt (a BaseException) in the GPU part drains the CPU job too."""
    path = tiny_dir("qwen3_moe")
    spec = detect(load_config(path))
    with load_hybrid_model(path, make_mask("random_half", spec), dtype=torch.float32, progress=False) as hybrid:
        block = next(b for b in hybrid.blocks.values() if len(b.cpu_tier) and len(b.gpu_tier))
        x = hidden(spec, seed=1)
        with torch.inference_mode():
            ref = block(x)
            fail_once_inside(block.gpu_tier, "forward", KeyboardInterrupt())
            with pytest.raises(KeyboardInterrupt):
                block(x)
            assert torch.equal(block(x), ref)
