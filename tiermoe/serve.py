"""`python -m tiermoe.serve`: `tiermoe serve` as a module, the entry point torchrun starts once per rank.

    torchrun --nproc-per-node 2 -m tiermoe.serve --model DIR --gpu-device cuda --num-gpus 2 --kt-num-gpu-experts 32

Takes exactly the flags of `tiermoe serve`. User errors print one line, `error: ...`, and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from tiermoe.cli.main import run_as_command
from tiermoe.cli.serve_flags import add_serve_flags
from tiermoe.cli.serve_run import run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tiermoe.serve",
        description="tiermoe serve as a module (for torchrun): one rank per GPU; rank 0 serves HTTP.")
    add_serve_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_as_command(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
