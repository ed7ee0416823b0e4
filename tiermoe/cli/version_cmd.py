"""tiermoe version: versions of tiermoe and what it runs on."""

from __future__ import annotations

from tiermoe.cli.flags import add_command


def add_parser(sub) -> None:
    add_command(sub, "version", "Print the versions of tiermoe, torch and transformers, and whether CUDA is usable.",
                "tiermoe version")


def run(args) -> int:
    import torch
    import transformers

    import tiermoe

    cuda = f"yes ({torch.cuda.device_count()} device(s))" if torch.cuda.is_available() else "no"
    print(f"tiermoe {tiermoe.__version__}\ntorch {torch.__version__}\ntransformers {transformers.__version__}\n"
          f"cuda {cuda}")
    return 0
