"""How many experts go to the GPU tier: from a count, a ratio, or GPU memory and the model's real bytes.

KTransformers' flags: --kt-num-gpu-experts N is per MoE layer (total N x MoE layers, over all GPUs together);
--kt-gpu-experts-ratio R gives floor(R x MoE layers x E) and wins when both are given. Dense layers hold no
routed experts. --gpu-memory-gb G is tiermoe's own: the GPU memory tiermoe may use in total; the GPU tier gets
what is left after the non-expert weights, the KV cache reservation (which the engine then enforces as its token
budget), the layerwise-prefill buffer, the cuBLAS workspaces of the threads that run forwards, and the transient
bf16 copies FP8 weights are dequantised into.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tiermoe.errors import TiermoeError
from tiermoe.placement.kv_layout import kv_layout

GIB = 1 << 30


def total_gpu_experts(num_moe_layers: int, num_experts: int, num_gpu_experts: int | None = None,
                      ratio: float | None = None) -> int:
    """The GPU-expert total over all MoE layers, as SGLang-kt computes it."""
    total = num_moe_layers * num_experts
    if ratio is not None:
        if not 0.0 <= ratio <= 1.0:
            raise TiermoeError(f"--gpu-experts-ratio must be between 0.0 and 1.0, got {ratio}")
        if num_gpu_experts is not None:
            warnings.warn("both --num-gpu-experts and --gpu-experts-ratio given; the ratio wins", stacklevel=2)
        return int(total * ratio)
    if num_gpu_experts is None:
        return 0
    if num_gpu_experts < 0:
        raise TiermoeError(f"--num-gpu-experts must be >= 0 (experts per MoE layer), got {num_gpu_experts}")
    return min(num_gpu_experts * num_moe_layers, total)


def kv_bytes_per_token(cfg, dtype_bytes: int) -> int:
    """KV cache bytes one token adds to every sequence for as long as it runs: full-attention layers only.

    Sliding-window layers stop growing at their window and linear-attention layers keep a fixed state per
    sequence: tiermoe.placement.kv_layout counts those from the tokens and sequences (kv_cache_bytes)."""
    return kv_layout(cfg, dtype_bytes).full_per_token


# cuBLAS workspaces. PyTorch binds a workspace to every (cuBLAS handle, stream) pair that runs a matmul, one handle
# per thread, allocated from the caching allocator on first use and kept for the life of the process
# (aten/src/ATen/cuda/CublasHandlePool.cpp): CUBLAS_WORKSPACE_CONFIG's ":SIZE_KiB:COUNT" pairs summed, by default
# 32 MiB on Hopper (sm90, what NVIDIA recommends there) and 4096 KiB x 2 + 16 KiB x 8 = 8.125 MiB elsewhere; plus a
# cuBLASLt workspace per pair (CUBLASLT_WORKSPACE_SIZE KiB, default 1024, at most the cuBLAS one). The budget counts
# Hopper's default, the largest: 33 MiB per thread, 561 MiB for the engine thread and 16 sequence threads.
HOPPER_CUBLAS_WORKSPACE = 32 << 20
OTHER_CUBLAS_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLASLT_WORKSPACE = 1 << 20
_WORKSPACE_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_workspace_bytes(environ: Mapping[str, str] | None = None, hopper: bool = True) -> int:
    """GPU memory one thread's cuBLAS and cuBLASLt workspaces take on one stream, as PyTorch sizes them."""
    env = os.environ if environ is None else environ
    cublas = HOPPER_CUBLAS_WORKSPACE if hopper else OTHER_CUBLAS_WORKSPACE
    pairs = _WORKSPACE_PAIR.findall(env.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        cublas = sum(int(size) * 1024 * int(count) for size, count in pairs)
    try:
        lt = int(env.get("CUBLASLT_WORKSPACE_SIZE", "")) * 1024
    except ValueError:
        lt = CUBLASLT_WORKSPACE
    return cublas + min(lt, cublas)


def forward_threads(max_running: int) -> int:
    """Threads that run the model's forwards on the GPU: the engine's own only (a step is one forward for all
    running sequences, tiermoe.engine.engine), so one cuBLAS handle and workspace whatever `max_running` is."""
    return 1


def fp8_transient_bytes(threads: int, fp8_matrix: int, fp8_expert: int) -> int:
    """GPU memory FP8 weights take while dequantised for a matmul: every forward thread may hold the largest
    non-expert matrix at once (FP8Linear dequantises per call), and the MoE block one GPU-tier expert at a time
    (one thread runs a layer's experts for the whole batch). Inputs in bytes as dequantised (see
    tiermoe.model.held_bytes.fp8_dequant_bytes); 0 for checkpoints without FP8 weights."""
    return threads * fp8_matrix + fp8_expert


@dataclass(frozen=True)
class MemoryBudget:
    """GPU memory split, in bytes. `experts` is what is left for the GPU tier."""

    gpu_memory: int
    non_expert: int
    kv_cache: int
    prefill_buffer: int
    margin: int
    workspaces: int = 0  # cuBLAS workspaces of the forward threads
    fp8_transients: int = 0  # FP8 weights dequantised for a matmul

    @property
    def experts(self) -> int:
        return max(0, self.gpu_memory - self.non_expert - self.kv_cache - self.prefill_buffer - self.margin
                   - self.workspaces - self.fp8_transients)

    def experts_that_fit(self, bytes_per_expert: int, max_experts: int) -> int:
        return min(max_experts, self.experts // bytes_per_expert) if bytes_per_expert > 0 else max_experts

    def describe(self) -> str:
        parts = [("GPU memory", self.gpu_memory), ("non-expert weights", self.non_expert), ("KV cache", self.kv_cache),
                 ("prefill buffer", self.prefill_buffer), ("cuBLAS workspaces", self.workspaces),
                 ("FP8 transients", self.fp8_transients), ("margin", self.margin), ("left for experts", self.experts)]
        return ", ".join(f"{name} {value / GIB:.2f} GiB" for name, value in parts)


def auto_gpu_memory(device: str) -> tuple[int, int]:
    """(free bytes on `device`, safety margin): the margin is 5% of the device's total, at least 512 MiB."""
    if not torch.cuda.is_available() or not str(device).startswith("cuda"):
        raise TiermoeError("--gpu-memory-gb auto needs a CUDA device (--gpu-device cuda:N); give a number of GB instead")
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return free, max(512 << 20, total // 20)
