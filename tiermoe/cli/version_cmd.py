"""tiermoe version: the versions of tiermoe, torch and transformers, read from the installed packages' metadata so
the answer is instant (no torch import). `--check` runs version_check instead: it imports torch to say whether
CUDA is usable, and builds the CPU kernels to say which instruction set they use.
"""

from __future__ import annotations

import platform
import sys
from importlib.metadata import PackageNotFoundError, version

import tiermoe
from tiermoe.cli.flags import add_command

CHECK_MODULE = "tiermoe.cli.version_check"  # the run of `tiermoe version --check` (tiermoe.cli.main: run_module)


def add_parser(sub) -> None:
    p = add_command(sub, "version", "Print the versions of tiermoe, Python, torch and transformers (instantly, from "
                    "the installed packages). With --check, also whether CUDA is usable and the instruction set the "
                    "CPU expert kernels use (building them on first call: set-up scripts run it once).",
                    "tiermoe version", "tiermoe version --check", "tiermoe --version")
    p.add_argument("--check", dest="run_module", action="store_const", const=CHECK_MODULE, default=None,
                   help="also load torch: CUDA devices, and build the CPU kernels and print their instruction set")


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def version_lines() -> str:
    return (f"tiermoe {tiermoe.__version__}\npython {platform.python_version()} ({sys.executable})\n"
            f"torch {package_version('torch')}\ntransformers {package_version('transformers')}")


def run(args) -> int:
    print(version_lines())
    return 0
