"""How much memory can still be allocated on a device: what sizes the KV pool and bounds every resource flag."""

from __future__ import annotations

from pathlib import Path

import torch


def available_ram() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_free_bytes(device: str | torch.device) -> int | None:
    """Bytes that can still be allocated on `device`: free memory of a CUDA device, available RAM for the host."""
    parsed = torch.device(device)
    if parsed.type == "cuda":
        return torch.cuda.mem_get_info(parsed)[0]
    return available_ram()
