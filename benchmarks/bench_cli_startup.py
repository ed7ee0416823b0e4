"""How long `tiermoe` takes to start: wall time of fresh processes, beside `python -c pass` and
`python -c 'import torch, transformers'` measured in the same run.

Targets: `--help` of every command, `tiermoe version` and `tiermoe --version` under 0.5 s (they load neither torch
nor transformers); the commands that compute (`place`, `stats`, `fit`, `inspect`) within the torch and transformers
import time + 0.3 s. Each row is ROUNDS runs, taken in turn (round 1 of every row, then round 2, ...), so a slow
spell of the machine spreads over all rows rather than landing on one; the table gives the median and the range.

    python benchmarks/bench_cli_startup.py
    python benchmarks/bench_cli_startup.py --rounds 9 --json startup.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HELP_BUDGET_S = 0.5  # --help, version: no torch
COMPUTE_MARGIN_S = 0.3  # place, stats, fit, inspect: beyond importing torch and transformers

TIERMOE = [sys.executable, "-m", "tiermoe.cli.main"]
COMMANDS = ("bench", "chat", "convert", "finetune", "fit", "generate", "inspect", "make-model", "place", "record",
            "stats", "trace", "serve", "version")


def rows(work: Path) -> list[tuple[str, list[str], str]]:
    """(label, argv, budget kind): the baselines, every command's --help, version, and the computing commands."""
    heat = work / "heat.csv"  # a statistics file `stats` reads without torch.save
    heat.write_text("layer," + ",".join(f"e{e}" for e in range(8)) + "\n"
                    + "".join(f"{layer}," + ",".join(str((layer + 1) * (e + 1)) for e in range(8)) + "\n"
                              for layer in range(4)))
    return [
        ("python -c pass", [sys.executable, "-c", "pass"], "baseline"),
        ("python -c 'import torch, transformers'", [sys.executable, "-c", "import torch, transformers"], "baseline"),
        ("tiermoe --help", [*TIERMOE, "--help"], "help"),
        ("tiermoe --version", [*TIERMOE, "--version"], "help"),
        ("tiermoe version", [*TIERMOE, "version"], "help"),
        *[(f"tiermoe {name} --help", [*TIERMOE, name, "--help"], "help") for name in COMMANDS],
        ("tiermoe place --num-layers 4 --num-experts 8 --num-gpu-experts 2",
         [*TIERMOE, "place", "--num-layers", "4", "--num-experts", "8", "--num-gpu-experts", "2"], "compute"),
        ("tiermoe stats heat.csv", [*TIERMOE, "stats", str(heat)], "compute"),
        ("tiermoe fit (demo model)", [*TIERMOE, "fit"], "compute"),
        ("tiermoe inspect (demo model)", [*TIERMOE, "inspect"], "compute"),
    ]


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):  # fit says 1 when something does not fit: still a measured start
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="runs of each command (default 5, at least 5)")
    parser.add_argument("--json", help="also write every time to this file")
    args = parser.parse_args()
    if not 5 <= args.rounds <= 1000:
        parser.error(f"--rounds: expected 5 to 1000 rounds, got {args.rounds}")
    with tempfile.TemporaryDirectory() as work:
        table = rows(Path(work))
        times: dict[str, list[float]] = {label: [] for label, _, _ in table}
        for _ in range(args.rounds):
            for label, argv, _ in table:
                times[label].append(timed(argv))
    imports = statistics.median(times["python -c 'import torch, transformers'"])
    budgets = {"help": HELP_BUDGET_S, "compute": imports + COMPUTE_MARGIN_S}
    print(f"{'command':<66} {'median s':>9} {'min-max s':>13}  budget")
    for label, _, kind in table:
        median = statistics.median(times[label])
        budget = budgets.get(kind)
        verdict = "" if budget is None else f"{'ok' if median <= budget else 'OVER'} (< {budget:.2f} s)"
        print(f"{label:<66} {median:>9.3f} {min(times[label]):>6.3f}-{max(times[label]):<6.3f}  {verdict}")
    print(f"\n{args.rounds} rounds; {sys.executable}; budgets: --help and version {HELP_BUDGET_S} s, computing "
          f"commands the torch + transformers import ({imports:.2f} s) + {COMPUTE_MARGIN_S} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "seconds": times}, indent=1))


if __name__ == "__main__":
    main()
