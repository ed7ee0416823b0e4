"""Measure a device as the GPU tier sees it: a GPUProfile of memory bandwidth, compute rate, copy bandwidth
and per-op launch overhead, on the model's real expert shapes.

`benchmarks/gpu_check.sh` runs `measure_profile` on CUDA to calibrate the presets; `--gpu-profile this-cpu`
runs it on the host CPU (for the non-expert forward and copies; the GPU tier's experts are timed directly there,
see pass_cost), so the cost model is checked against runs with the GPU tier on the CPU device.
- bandwidth: one token through a stack of expert gate/up matrices as one matrix (one kernel, so launch overhead
  does not hide it), as large as the model's experts (so caches help as much as when serving this model), within
  64 MiB - 1 GiB;
- compute: an expert's gate/up matrix with 512 token rows (prefill-sized), 2 flops per weight per row;
- copy: whole experts to the device (from pinned memory when the device is CUDA), as tier swaps copy them;
- launch: a one-element add, the smallest op, many times (then one synchronisation).
Every figure is the best of a few repetitions: the machine may be shared.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tiermoe.placement.profiles import GPUProfile


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """A function that waits for the work queued on `device`, so a time taken after it is real (a no-op on the
    CPU, whose ops return when done)."""
    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def best_time(fn: Callable[[], None], sync: Callable[[], None], repeats: int = 5) -> float:
    """Best wall time of `fn` over `repeats` runs (after one warm-up), synchronised."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def launch_seconds(device: torch.device, calls: int = 2000, repeats: int = 3) -> float:
    """Seconds per smallest op on `device` (dispatch + launch)."""
    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)

    def run():
        for _ in range(calls):
            torch.add(a, b)

    return best_time(run, synchronizer(device), repeats) / calls


def measure_profile(device: str | torch.device, hidden: int, inter: int, dtype: torch.dtype,
                    working_set_bytes: int, name: str | None = None, repeats: int = 3) -> GPUProfile:
    """A GPUProfile of `device` for experts of shape hidden x inter in `dtype`.

    working_set_bytes: bytes the bandwidth measurement reads (the model's routed experts), within 64 MiB - 1 GiB.
    """
    device = torch.device(device)
    sync = synchronizer(device)
    launch = launch_seconds(device)
    rows_per_expert = 2 * inter
    stacked = max(1, min(1 << 30, max(64 << 20, working_set_bytes)) // (rows_per_expert * hidden * dtype.itemsize))
    with torch.inference_mode():
        w = torch.empty(stacked * rows_per_expert, hidden, dtype=dtype, device=device).normal_()
        x1 = torch.randn(1, hidden, device=device).to(dtype)
        t_read = best_time(lambda: F.linear(x1, w), sync, repeats)
        bandwidth = w.numel() * w.element_size() / max(t_read - launch, 0.5 * t_read)
        rows = 512
        xm = torch.randn(rows, hidden, device=device).to(dtype)
        one = w[:rows_per_expert]
        t_math = best_time(lambda: F.linear(xm, one), sync, repeats)
        flops = 2.0 * rows * rows_per_expert * hidden / t_math
        copy = _copy_bandwidth(device, hidden, inter, dtype, repeats)
    label = name or ("this-cpu" if device.type == "cpu" else torch.cuda.get_device_name(device))
    # torch's grouped GEMM is one kernel per projection on compute capability 9.x, a loop over the groups elsewhere
    fused = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return GPUProfile(label, memory_bandwidth=bandwidth, compute_flops=flops, pcie_bandwidth=copy,
                      launch_overhead=launch, fused_grouped_gemm=fused)


def _copy_bandwidth(device: torch.device, hidden: int, inter: int, dtype: torch.dtype, repeats: int) -> float:
    """Host -> device bytes/s for whole experts (pinned source on CUDA), at least 64 MiB per measurement."""
    expert_bytes = 3 * inter * hidden * dtype.itemsize
    count = max(4, (64 << 20) // expert_bytes)
    pin = device.type == "cuda"
    src = torch.empty(count, 3 * inter * hidden, dtype=dtype, pin_memory=pin)
    src.fill_(1)
    dst = torch.empty_like(src, device=device)
    seconds = best_time(lambda: [dst[i].copy_(src[i], non_blocking=pin) for i in range(count)], synchronizer(device), repeats)
    return count * expert_bytes / seconds
