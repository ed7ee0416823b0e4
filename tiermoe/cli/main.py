"""`tiermoe` console script: one subcommand per module, each with its own --help and examples.

User errors (TiermoeError) print one line, `error: ...`, and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from tiermoe.errors import TiermoeError

# subcommand -> (module with add_parser(subparsers) and run(args), one line for `tiermoe --help`). Only the
# command being run is imported: the library loads torch and transformers, which `tiermoe --help` does not need.
COMMANDS = {
    "bench": ("tiermoe.cli.bench_cmd", "placement benchmarks: strategies x GPU ratios, or a trace replayed"),
    "chat": ("tiermoe.cli.chat_cmd", "chat in the terminal, with a server (--url) or a model loaded here"),
    "convert": ("tiermoe.cli.convert_cmd", "convert the CPU-tier experts once (int4, int8, bf16)"),
    "finetune": ("tiermoe.cli.finetune_cmd", "LoRA fine-tuning on chat data, experts on both tiers (KT's settings)"),
    "fit": ("tiermoe.cli.fit_cmd", "will a model fit: GPU and host memory from headers or a config.json"),
    "generate": ("tiermoe.cli.generate_cmd", "stream one reply to a prompt"),
    "inspect": ("tiermoe.cli.inspect_cmd", "architecture, MoE layers and bytes of a checkpoint, from headers"),
    "make-model": ("tiermoe.cli.make_model", "a random checkpoint with a real model's shapes (tests, benchmarks)"),
    "place": ("tiermoe.cli.place_cmd", "choose the GPU-tier experts and write plan.json"),
    "record": ("tiermoe.cli.record_cmd", "run real prompts and record which experts each layer routes to"),
    "stats": ("tiermoe.cli.stats_cmd", "skew, dead experts and expected hit rates of a statistics file"),
    "trace": ("tiermoe.cli.trace_cmd", "convert routing traces from other tools, or generate realistic ones"),
    "serve": ("tiermoe.cli.serve_cmd", "OpenAI- and Ollama-compatible HTTP server with continuous batching"),
    "version": ("tiermoe.cli.version_cmd", "versions, CUDA, and the CPU kernels' instruction set"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with `command`'s full flags (its module imported); every other command is listed only."""
    parser = argparse.ArgumentParser(
        prog="tiermoe",
        description="Run Mixture-of-Experts models with hot experts on the GPU tier and cold experts on the CPU tier.",
        epilog="Run 'tiermoe COMMAND --help' for a command's flags and examples.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {message}", file=sys.stderr)


def run_as_command(run, args) -> int:
    """`run(args)` as a command line runs it: warnings as one line, a TiermoeError as `error: ...` and status 2
    (no traceback), Ctrl-C as status 130. Shared by `tiermoe` and `python -m tiermoe.serve`."""
    warnings.showwarning = _one_line_warning  # a CLI user wants the message, not our source line
    try:
        return run(args) or 0
    except TiermoeError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except KeyboardInterrupt as stop:  # a message, when the command says what the interruption cut short
        print(f"interrupted: {stop}" if str(stop) else "interrupted", file=sys.stderr, flush=True)
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return run_as_command(importlib.import_module(COMMANDS[args.command][0]).run, args)


if __name__ == "__main__":
    sys.exit(main())
