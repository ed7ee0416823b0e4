"""Expert distribution recorder flags, SGLang's names, shared by every command that runs the engine.

`add_recorder_flags(parser)` adds --expert-distribution-recorder-mode, --expert-distribution-recorder-buffer-size
and --record-kt-gpu-expert-distribution (light: parsers import it for `--help`); tiermoe.cli.recorder_args's
`recorder_from_args(args, spec)` builds the recorder to pass to `LLM(..., recorder=...)` (NO_RECORDER when no mode
is given, as SGLang's default). Dump it at the end with `tiermoe.stats.io.dump_recorder(recorder, path)`, which
writes to $TIERMOE_EXPERT_DISTRIBUTION_RECORDER_DIR (else $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp as
SGLang) when no path is given.
"""

from __future__ import annotations

import argparse

from tiermoe.cli.choices import RECORDER_MODES, SGLANG_DEFAULT_BUFFER_SIZE


def buffer_size(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not an integer") from None
    if number == 0 or number < -1:
        raise argparse.ArgumentTypeError(f"expected -1 (unbounded) or a number of passes >= 1, got {number}")
    return number


def add_recorder_flags(p: argparse.ArgumentParser, mode_flags: tuple[str, ...] = (), default_mode: str | None = None,
                       default_buffer_size: int | None = None) -> None:
    """mode_flags: extra spellings of the mode flag (`record` adds --mode); defaults differ per command."""
    g = p.add_argument_group("expert distribution recorder (SGLang's flags)")
    g.add_argument("--expert-distribution-recorder-mode", *mode_flags, dest="recorder_mode", choices=RECORDER_MODES,
                   default=default_mode,
                   help="stat: counts [layers, experts]; per_pass: counts per forward pass; per_token: every token's "
                        "request, position and routed experts; stat_approx: same as stat "
                        f"(default: {default_mode or 'off'})")
    size_default = ("unbounded" if default_buffer_size == -1 else
                    f"{default_buffer_size or SGLANG_DEFAULT_BUFFER_SIZE} passes")
    g.add_argument("--expert-distribution-recorder-buffer-size", dest="recorder_buffer_size", type=buffer_size,
                   metavar="N", default=default_buffer_size,
                   help=f"forward passes kept: the last N (a circular buffer, as SGLang), or -1 for all "
                        f"(default: {size_default})")
    g.add_argument("--record-kt-gpu-expert-distribution", dest="record_gpu_masks", action="store_true",
                   help="also snapshot the GPU-tier mask of every pass (gpu_expert_masks [passes, layers, experts] "
                        "in the dump), to check a run against its placement")
