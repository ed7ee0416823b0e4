"""tiermoe version: versions of tiermoe and what it runs on."""

from __future__ import annotations

import tiermoe
from tiermoe.cli.flags import add_command
from tiermoe.experts.kernels import supported_isa


def add_parser(sub) -> None:
    add_command(sub, "version", "Print the versions of tiermoe, torch and transformers, whether CUDA is usable, and the instruction set "
                "the CPU expert kernels use (building them on first call).",
                "tiermoe version")


def run(args) -> int:
    import torch
    import transformers


    isa = supported_isa()
    cuda = f"yes ({torch.cuda.device_count()} device(s))" if torch.cuda.is_available() else "no"
    print(f"tiermoe {tiermoe.__version__}\ntorch {torch.__version__}\ntransformers {transformers.__version__}\n"
          f"cuda {cuda}\ncpu kernels {'unavailable (pure-torch path)' if isa is None else isa}")
    return 0
