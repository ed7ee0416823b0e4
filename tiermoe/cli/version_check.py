"""`tiermoe version --check`: the versions, then what tiermoe runs on here: CUDA devices (torch imported) and the
CPU kernels' instruction set (built on first call, so a set-up script can build them ahead of the first model)."""

from __future__ import annotations

import torch

from tiermoe.cli.version_cmd import version_lines
from tiermoe.experts.kernels import supported_isa


def run(args) -> int:
    isa = supported_isa()
    cuda = f"yes ({torch.cuda.device_count()} device(s))" if torch.cuda.is_available() else "no"
    print(f"{version_lines()}\ncuda {cuda}\ncpu kernels {'unavailable (pure-torch path)' if isa is None else isa}")
    return 0
