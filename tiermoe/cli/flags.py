"""Flag types shared by commands: parse, check, and say what is expected when a value is wrong."""

from __future__ import annotations

import argparse

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def dtype_flag(value: str) -> torch.dtype:
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"'{value}' is not a dtype; expected one of {', '.join(DTYPES)}")
    return DTYPES[value]


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {number}")
    return number


def non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not an integer") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {number}")
    return number


def examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def add_command(sub, name: str, help_text: str, *example_lines: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, description=help_text, epilog=examples(*example_lines),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def non_negative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a number") from None
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return number


def unit_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a number") from None
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return number
