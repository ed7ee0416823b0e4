"""`tiermoe` console script: one subcommand per module pair, each with its own --help and examples.

Each command is a light parser module (`add_parser(sub)`: flags, help, examples) and a run module (`run(args)`),
named in COMMANDS. `tiermoe CMD --help`, a bad flag, `tiermoe --version` import only CMD's parser, which loads
neither torch nor transformers (tests/test_cli_startup.py checks it); the run module, which does, is imported only
when the command runs. A parser may name another run module for one form of its command (`args.run_module`, e.g.
`version --check`).

User errors (TiermoeError) print one line, `error: ...`, and exit with status 2; no traceback. So do bad flags and
unknown commands, after a short usage line (not the whole page: `--help` has that), with a suggestion for a typo.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple

import tiermoe
from tiermoe.bundled.demo_notice import demo_model_notice
from tiermoe.errors import TiermoeError


class Command(NamedTuple):
    parser: str  # module with add_parser(subparsers): light, no torch
    runner: str  # module with run(args) -> int
    summary: str  # one line for `tiermoe --help`


COMMANDS = {
    "bench": Command("tiermoe.cli.bench_cmd", "tiermoe.cli.bench_run",
                     "placement benchmarks: strategies x GPU ratios, or a trace replayed"),
    "chat": Command("tiermoe.cli.chat_cmd", "tiermoe.cli.chat_cmd",
                    "chat in the terminal, with a server (--url) or a model loaded here"),
    "convert": Command("tiermoe.cli.convert_cmd", "tiermoe.cli.convert_run",
                       "convert the CPU-tier experts once (int4, int8, bf16)"),
    "finetune": Command("tiermoe.cli.finetune_cmd", "tiermoe.cli.finetune_run",
                        "LoRA fine-tuning on chat data, experts on both tiers (KT's settings)"),
    "fit": Command("tiermoe.cli.fit_cmd", "tiermoe.cli.fit_run",
                   "will a model fit: GPU and host memory from headers or a config file"),
    "generate": Command("tiermoe.cli.generate_cmd", "tiermoe.cli.generate_run", "stream one reply to a prompt"),
    "inspect": Command("tiermoe.cli.inspect_cmd", "tiermoe.cli.inspect_run",
                       "architecture, MoE layers and bytes of a checkpoint, from headers"),
    "make-model": Command("tiermoe.cli.make_model", "tiermoe.cli.make_model_run",
                          "a random checkpoint with a real model's shapes (tests, benchmarks)"),
    "place": Command("tiermoe.cli.place_cmd", "tiermoe.cli.place_run",
                     "choose the GPU-tier experts and write plan.json"),
    "record": Command("tiermoe.cli.record_cmd", "tiermoe.cli.record_run",
                      "run real prompts and record which experts each layer routes to"),
    "stats": Command("tiermoe.cli.stats_cmd", "tiermoe.cli.stats_run",
                     "skew, dead experts and expected hit rates of a statistics file"),
    "trace": Command("tiermoe.cli.trace_cmd", "tiermoe.cli.trace_run",
                     "convert routing traces from other tools, or generate realistic ones"),
    "serve": Command("tiermoe.cli.serve_cmd", "tiermoe.cli.serve_run",
                     "OpenAI- and Ollama-compatible HTTP server with continuous batching"),
    "version": Command("tiermoe.cli.version_cmd", "tiermoe.cli.version_cmd",
                       "versions of tiermoe, torch and transformers (--check: CUDA, CPU kernels)"),
}


class CommandLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one `error:` line after a short usage line, with the way to the full
    help, instead of the whole usage block (37 lines for `serve`). Subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"usage: {short_usage(self)}  (run '{self.prog} --help' for every flag)\n"
                     f"error: {message}{suggestion(self, message)}\n")


def short_usage(parser: argparse.ArgumentParser) -> str:
    """`PROG REQUIRED-FLAGS [options] POSITIONALS`: what a command cannot do without, e.g.
    `tiermoe record --dataset DATASET --num-prompts NUM_PROMPTS [options]`."""
    words = [parser.prog]
    for action in parser._actions:  # argparse has no public list of a parser's arguments
        if action.option_strings and action.required:
            words.append(f"{action.option_strings[0]} {action.metavar or action.dest.upper()}")
    words.append("[options]")
    for action in parser._actions:
        if action.option_strings:
            continue
        name = action.metavar or action.dest  # as argparse names positionals
        if isinstance(action, argparse._SubParsersAction):
            words.append(f"{name} ...")
        elif action.nargs == "?":
            words.append(f"[{name}]")
        elif action.nargs == "*":
            words.append(f"[{name} ...]")
        elif action.nargs == "+":
            words.append(f"{name} [{name} ...]")
        else:
            words.append(name)
    return " ".join(words)


# argparse's messages for a wrong choice and for flags it does not know (quotes differ between Python releases)
_INVALID_CHOICE = re.compile(
    r"(?:invalid choice|unknown command): '?(?P<given>[^' ]+)'? \(choose from (?P<choices>.*)\)")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (?P<given>\S+)")


def suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """"; did you mean 'X'?" when the error names a near miss of a choice or a flag, else ""."""
    if match := _INVALID_CHOICE.search(message):
        candidates = [c.strip(" '\"") for c in match["choices"].split(",")]
        given = match["given"]
    elif (match := _UNRECOGNIZED.search(message)) and match["given"].startswith("--"):
        given = match["given"].split("=")[0]
        candidates = [flag for action in parser._actions for flag in action.option_strings]
    else:
        return ""
    close = difflib.get_close_matches(given, candidates, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with `command`'s full flags (its parser module imported); every other command is listed only."""
    parser = CommandLineParser(
        prog="tiermoe",
        description="Run Mixture-of-Experts models with hot experts on the GPU tier and cold experts on the CPU tier.",
        epilog="Run 'tiermoe COMMAND --help' for a command's flags and examples.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"tiermoe {tiermoe.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, entry in COMMANDS.items():
        if name == command:
            importlib.import_module(entry.parser).add_parser(sub)
        else:
            sub.add_parser(name, help=entry.summary, add_help=False)
    return parser


def innermost_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)subcommand `args` ran, e.g. `tiermoe bench placement`'s: the one whose usage a bad
    flag should show."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                return innermost_parser(action.choices[chosen], args)
    return parser


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {message}", file=sys.stderr)


def run_as_command(run, args) -> int:
    """`run(args)` as a command line runs it: warnings as one line, a TiermoeError as `error: ...` and status 2
    (no traceback), Ctrl-C as status 130. Shared by `tiermoe` and `python -m tiermoe.serve`."""
    warnings.showwarning = _one_line_warning  # a CLI user wants the message, not our source line
    try:
        with demo_model_notice():  # a command that falls back on the bundled model says once what it is
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


def parse_command(argv: list[str]) -> tuple[Callable[[argparse.Namespace], int], argparse.Namespace] | None:
    """The run function of the command `argv` names (its run module imported) and the parsed flags: the process is
    then ready to do the command's own work. None, after the help, when `argv` names no command; a bad flag or an
    unknown command exits here (status 2)."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    if command is not None and command not in COMMANDS:
        parser.error(f"unknown command: '{command}' (choose from {', '.join(COMMANDS)})")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # shown with the usage of the command they were given to, not the top level's
        innermost_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return None
    run_module = getattr(args, "run_module", None) or COMMANDS[args.command].runner
    return importlib.import_module(run_module).run, args


def main(argv: list[str] | None = None) -> int:
    parsed = parse_command(sys.argv[1:] if argv is None else argv)
    return 2 if parsed is None else run_as_command(*parsed)


if __name__ == "__main__":
    sys.exit(main())
