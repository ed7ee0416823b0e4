"""Small validated settings shared by commands and the library."""

from __future__ import annotations

import torch

from tiermoe.errors import TiermoeError


def check_device(device: str) -> str:
    """Validate a --gpu-device value: "cpu", "cuda" or "cuda:N" for a CUDA device that exists."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise TiermoeError(f"--gpu-device '{device}' is not a device; expected cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type != "cuda":
        raise TiermoeError(f"--gpu-device '{device}' is not supported; expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise TiermoeError(f"--gpu-device {device}: CUDA is not available on this machine; use --gpu-device cpu")
    index = parsed.index or 0
    if index >= torch.cuda.device_count():
        raise TiermoeError(f"--gpu-device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"
