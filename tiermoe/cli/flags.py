"""Flag types shared by commands: parse, check, and say what is expected when a value is wrong.

Light on purpose: every command's parser imports this module, and `tiermoe CMD --help` must not load torch.

Numbers are finite and fit in 64 bits (a value that does not would fail later, inside torch or C++, with a
traceback); output files are checked before any work starts, so a long run never fails at its last step
because its --out or --plot names a missing directory.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from tiermoe.cli.choices import DTYPE_NAMES, MAX_TRAINING_SEQUENCE
from tiermoe.config import MAX_RUNNING_REQUESTS

_TORCH_NAMES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}  # DTYPE_NAMES -> torch's attribute


def dtype_flag(value: str):
    """A --dtype name (bf16, fp32, fp16) as the torch.dtype. torch is imported when a value is parsed, which only a
    command that runs does: `--help` never imports it."""
    if value not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"'{value}' is not a dtype; expected one of {', '.join(DTYPE_NAMES)}")
    import torch

    return getattr(torch, _TORCH_NAMES[value])


MAX_INT = 2**63 - 1  # what torch and the C++ kernels take; anything that large is a typo
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes


def _int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not an integer") from None
    if number > MAX_INT:
        raise argparse.ArgumentTypeError(f"expected an integer at most 2**63 - 1, got {value}")
    return number


def positive_int(value: str) -> int:
    number = _int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {number}")
    return number


def port_number(value: str) -> int:
    number = _int(value)
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 1..65535, got {number}")
    return number


def non_negative_int(value: str) -> int:
    number = _int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {number}")
    return number


def expert_chunk(value: str) -> int:
    """Tokens the CPU tier computes at a time in training (finetune --expert-chunk, fit --train --expert-chunk: one
    bound, so the command fit prints is one finetune takes)."""
    number = non_negative_int(value)
    if number > MAX_TRAINING_SEQUENCE:
        raise argparse.ArgumentTypeError(f"expected an expert chunk between 0 and {MAX_TRAINING_SEQUENCE:,} tokens "
                                         f"(0: the whole context), got {number:,}")
    return number


def running_count(value: str) -> int:
    """Sequences run together (serve --max-running-requests, record --batch-size): a positive integer up to
    MAX_RUNNING_REQUESTS (tiermoe.config says why)."""
    number = positive_int(value)
    if number > MAX_RUNNING_REQUESTS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_RUNNING_REQUESTS} sequences at once (each holds a KV "
                                         f"cache and its share of every step), got {number}")
    return number


def seed_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not an integer seed") from None
    if not 0 <= number <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed between 0 and 2**64 - 1, got {value}")
    return number


def examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def add_command(sub, name: str, help_text: str, *example_lines: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, description=help_text, epilog=examples(*example_lines),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def finite_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a number") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {value}")
    return number


def non_negative_float(value: str) -> float:
    number = finite_float(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return number


def positive_float(value: str) -> float:
    number = finite_float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return number


def unit_float(value: str) -> float:
    number = finite_float(value)
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return number


def fraction(value: str) -> float:
    number = finite_float(value)
    if not 0 <= number <= 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {value}")
    return number


def output_file(value: str) -> str:
    """A file to write: its directory exists and it is not itself a directory."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"'{value}' is a directory; expected a file name")
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist (create it first)"
        raise argparse.ArgumentTypeError(f"directory '{parent}' {what}")
    return value


def output_file_new_dirs(value: str) -> str:
    """A file to write whose missing directories are created: nothing on its way is a file, it is no directory."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"'{value}' is a directory; expected a file name")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise argparse.ArgumentTypeError(f"'{ancestor}' is not a directory")
    return value


# what matplotlib writes (a name without an extension is written as PNG)
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "webp", "tif", "tiff", "eps", "ps", "pgf", "raw", "rgba")


def plot_file(value: str) -> str:
    """An image file to draw: an output_file whose extension matplotlib can write."""
    output_file(value)
    suffix = Path(value).suffix.lower().lstrip(".")
    if suffix and suffix not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(f"cannot draw '{value}': expected one of .{', .'.join(PLOT_FORMATS)}")
    return value


def output_dir(value: str) -> str:
    """A directory to create (or an existing one): not a file, and nothing on its way is a file."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"'{value}' exists and is not a directory")
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise argparse.ArgumentTypeError(f"'{ancestor}' is not a directory")
    return value
