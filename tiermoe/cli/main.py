"""`tiermoe` console script: one subcommand per module, each with its own --help and examples.

User errors (TiermoeError) print one line, `error: ...`, and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tiermoe.errors import TiermoeError

# subcommand -> module with add_parser(subparsers) and run(args)
COMMANDS = {
    "bench": "tiermoe.cli.bench_cmd",
    "chat": "tiermoe.cli.chat_cmd",
    "convert": "tiermoe.cli.convert_cmd",
    "fit": "tiermoe.cli.fit_cmd",
    "generate": "tiermoe.cli.generate_cmd",
    "inspect": "tiermoe.cli.inspect_cmd",
    "make-model": "tiermoe.cli.make_model",
    "place": "tiermoe.cli.place_cmd",
    "record": "tiermoe.cli.record_cmd",
    "stats": "tiermoe.cli.stats_cmd",
    "serve": "tiermoe.cli.serve_cmd",
    "version": "tiermoe.cli.version_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiermoe",
        description="Run Mixture-of-Experts models with hot experts on the GPU tier and cold experts on the CPU tier.",
        epilog="Run 'tiermoe COMMAND --help' for a command's flags and examples.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {message}", file=sys.stderr)


def run_as_command(run, args) -> int:
    """`run(args)` as a command line runs it: warnings as one line, a TiermoeError as `error: ...` and status 2
    (no traceback), Ctrl-C as status 130. Shared by `tiermoe` and `python -m tiermoe.serve`."""
    import warnings


    warnings.showwarning = _one_line_warning  # a CLI user wants the message, not our source line
    try:
        return run(args) or 0
    except TiermoeError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return run_as_command(lambda a: importlib.import_module(COMMANDS[a.command]).run(a), args)


if __name__ == "__main__":
    sys.exit(main())
