"""`python -m tiermoe.analysis.gpu_check.child`: one check of the GPU run, alone in its own process.

Its own process because a check can hang inside a CUDA call (no Python exception can stop it there), crash the
process (a kernel fault), or leave the CUDA context unusable (a device-side error is sticky): the next check
then still starts clean, and the parent can always kill this one. At the deadline faulthandler writes the stack
of every thread to stderr (the streamed log), then ends the process: a hang is reported with where it hung.
The result goes to a file the parent reads; nothing here writes to $OUT except what the check itself saves.
Standard library only until the check's own module is imported.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import sys
import time
import traceback

from tiermoe.analysis.gpu_check.plan import CheckContext


def load_target(target: str):
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def run_check(target: str, ctx: CheckContext) -> dict:
    """Call the check; a check that raises is a failed check, reported with its traceback."""
    try:
        result = dict(load_target(target)(ctx))
    except Exception as err:  # noqa: BLE001 - any failure of a check is its result
        result = {"status": "fail", "error": f"{type(err).__name__}: {err}",
                  "traceback": traceback.format_exc(limit=8)}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tiermoe.analysis.gpu_check.child")
    parser.add_argument("--target", required=True)
    parser.add_argument("--context", required=True, help="CheckContext as JSON")
    parser.add_argument("--result", required=True, help="file to write the result dict to (JSON)")
    args = parser.parse_args(argv)
    ctx = CheckContext.from_json(args.context)
    faulthandler.enable()  # a segfault in a kernel prints where it happened
    faulthandler.dump_traceback_later(max(1.0, ctx.deadline - time.time()), exit=True)
    result = run_check(args.target, ctx)
    faulthandler.cancel_dump_traceback_later()
    with open(args.result, "w") as f:
        json.dump(result, f, default=str)
    # Skip the interpreter's teardown: a worker thread a check left running, or CUDA's own shutdown, must not
    # turn a finished check into a hang.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
