"""A MoE layer's host <-> device copies with the fewest waits: the CPU tier's inputs in one copy, its result back
without one.

A device-to-host copy makes the host wait until the device has produced what it copies, so three copies (hidden
states, expert ids, routing weights) are three waits per layer per decode step; their bytes go over PCIe in one
copy instead, and the host waits once. The result goes back from page-locked memory with `non_blocking`, so the
host queues the rest of the layer at once (PyTorch's pinned allocator keeps the buffer until the copy is done).
On a CPU main device every copy is a no-op, but the same operations run, so the CPU path counts what a GPU
would wait for (tiermoe.testing.host_syncs).
"""

from __future__ import annotations

import torch


def to_host_together(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host copies of `tensors` made with ONE device-to-host copy (their bytes packed, widest elements first so
    every part stays aligned for its dtype); each result is a view of that one host buffer."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    packed = torch.cat([tensors[i].contiguous().reshape(-1).view(torch.uint8) for i in order]).to("cpu")
    out: list[torch.Tensor | None] = [None] * len(tensors)
    offset = 0
    for i in order:
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        out[i] = packed[offset:offset + nbytes].view(t.dtype).view(t.shape)
        offset += nbytes
    return out


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` without the host waiting: from page-locked memory with non_blocking on CUDA (a host
    copy of a decode step's [T, D] result costs microseconds); the same tensor on a CPU device."""
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
