"""Every flag of `tiermoe serve`, shared by the command, `python -m tiermoe.serve` (the torchrun entry point) and
the rank launcher (which hands rank 0's flags on to the other ranks)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from tiermoe.cli.cpu_flags import add_cpu_flags
from tiermoe.cli.flags import positive_int
from tiermoe.cli.generate_cmd import add_model_flags
from tiermoe.cli.placement_flags import add_dynamic_flags, add_placement_flags
from tiermoe.cli.recorder_flags import add_recorder_flags
from tiermoe.cli.sglang_flags import add_sglang_compat_flags
from tiermoe.config import DEFAULT_MAX_REQUEST_BYTES
from tiermoe.distributed.group import DEFAULT_DIST_TIMEOUT_S
from tiermoe.errors import TiermoeError

API_KEY_VARIABLE = "TIERMOE_API_KEY"


def seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a number of seconds") from None
    if not 0 < number < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {value}")
    return number


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of `tiermoe serve` (also parsed by `python -m tiermoe.serve`, the torchrun entry point)."""
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=positive_int, default=30000, help="port (default 30000)")
    p.add_argument("--served-model-name", help="model name reported by /v1/models (default: the directory name)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health (any user "
                   f"can read a command line in `ps`: prefer --api-key-file or ${API_KEY_VARIABLE})")
    p.add_argument("--api-key-file", metavar="PATH",
                   help=f"read the API key from this file (its first line); else ${API_KEY_VARIABLE} is used if set")
    p.add_argument("--max-running-requests", type=positive_int, default=32,
                   help="requests decoded together at most; more wait in a queue (default 32)")
    p.add_argument("--chunked-prefill-size", type=positive_int, default=512,
                   help="prompt tokens prefilled per step over all requests (default 512)")
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="max_tokens of requests that give none (default 256)")
    p.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="a request body longer than this is refused with 413 before it is read whole "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES >> 20} MiB, at most 1 GiB)")
    add_placement_flags(p)
    add_dynamic_flags(p)
    add_cpu_flags(p)
    add_recorder_flags(p)
    add_sglang_compat_flags(p)
    g = p.add_argument_group("several GPUs (one rank per GPU; see docs/multi-gpu.md)")
    g.add_argument("--dist-timeout", dest="dist_timeout", type=seconds, default=DEFAULT_DIST_TIMEOUT_S,
                   help="seconds a rank waits for the others in one collective before it gives up with an error "
                        "(a rank died or hangs); idle ranks exchange heartbeats, so idleness never trips it "
                        f"(default {DEFAULT_DIST_TIMEOUT_S:g})")


def api_key_from_args(args, environ=None) -> str | None:
    """The API key the server requires: --api-key, else the first line of --api-key-file, else $TIERMOE_API_KEY
    (an empty variable counts as unset), else None (no key)."""
    environ = os.environ if environ is None else environ
    flag, path = getattr(args, "api_key", None), getattr(args, "api_key_file", None)
    if flag is not None and path is not None:
        raise TiermoeError("give --api-key or --api-key-file, not both")
    if flag is not None:
        return flag
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            reason = getattr(err, "strerror", None) or err
            raise TiermoeError(f"cannot read --api-key-file '{path}': {reason}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise TiermoeError(f"--api-key-file '{path}' is empty; expected the key on its first line")
        return key
    return environ.get(API_KEY_VARIABLE) or None
