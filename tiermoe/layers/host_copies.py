"""A host result on the device without the host waiting for the copy: for results that do not come back through a
layer's page-locked ring (tiermoe.layers.host_ring, which makes the CPU tier's inputs one copy and one wait), such
as deferred experts' jobs. On a CPU main device the copy is a no-op, but the same operation runs, so the CPU path
counts what a GPU would wait for (tiermoe.testing.host_syncs).
"""

from __future__ import annotations

import torch


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` without the host waiting: from page-locked memory with non_blocking on CUDA (a host
    copy of a decode step's [T, D] result costs microseconds); the same tensor on a CPU device."""
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
