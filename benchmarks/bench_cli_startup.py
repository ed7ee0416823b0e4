"""How long `tiermoe` takes to start: wall time of fresh processes, beside `python -c pass`, `import torch`,
`import torch, transformers` and transformers building the demo model's classes, all measured in the same run.

Targets (issue 61): `--help` of every command, `tiermoe version` and `tiermoe --version` under 0.5 s (they load
neither torch nor transformers); the commands that compute (`place`, `stats`, `fit`, `inspect`) start within the
`import torch` time + 0.3 s; `generate` on the demo model shows its first token within 1 s of
`import torch, transformers`.

What is timed, from the moment the process is spawned:
- start: until the command is ready to do its own work: its flags parsed and its run module imported, with
  everything that imports at module level (`tiermoe.cli.main.parse_command`; the next step is `run(args)`);
- first token (generate): until the first byte of the reply reaches stdout;
- total: until the process exits.
Beside start and total, the CPU time the process had used (user + system): a busy machine stretches it far less
than the wall time, so it is the figure to compare between runs made under different loads.
The computing commands are judged by their start and, beside it, by their total. Those given a checkpoint (fit,
inspect, place of the demo model) need transformers' model classes for their work: the architecture is discovered
from the modules transformers builds on the meta device. Whether they import them before `run` (inspect), in part
(fit: transformers and its configs before, the model classes in it) or in it (place), their total is bounded below
by the row "transformers builds the demo's model": what any program pays to instantiate the demo's transformers
model.

Each row is ROUNDS runs, taken in turn (round 1 of every row, then round 2, ...), so a slow spell of the machine
spreads over all rows rather than landing on one; the table gives the median and the range. With --compare-tree
the computing commands and generate of another tiermoe source tree (e.g. `git archive REV | tar -x -C DIR`) run
too, alternating. The processes run in an empty directory (so the tree on PYTHONPATH is the one imported) and keep
compiled bytecode as an installed package does (in a cache of the run, filled by one round that is not counted),
also where PYTHONDONTWRITEBYTECODE is set; --no-bytecode-cache compiles every module in every process instead.

    python benchmarks/bench_cli_startup.py
    python benchmarks/bench_cli_startup.py --rounds 9 --json startup.json
    mkdir ../tiermoe-before && git archive REV | tar -x -C ../tiermoe-before   # REV: the commit to compare with
    python benchmarks/bench_cli_startup.py --compare-tree ../tiermoe-before
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tiermoe.bundled import BUNDLED_MODEL_DIR  # light: no torch

HELP_BUDGET_S = 0.5  # --help, version: no torch
COMPUTE_MARGIN_S = 0.3  # place, stats, fit, inspect: start beyond importing torch
FIRST_TOKEN_MARGIN_S = 1.0  # generate on the demo: first token beyond importing torch and transformers

STARTED = "tiermoe-bench-started"
# `tiermoe ARGV` as tiermoe.cli.main runs it, saying on stderr (wall clock) when the command is ready to run; a tree
# older than parse_command runs main() and says nothing (no start figure)
PROBE = f"""
import sys, time
try:
    from tiermoe.cli.main import parse_command, run_as_command
except ImportError:
    from tiermoe.cli.main import main
    sys.exit(main(sys.argv[1:]))
parsed = parse_command(sys.argv[1:])
print("{STARTED}", time.time(), time.process_time(), file=sys.stderr, flush=True)
sys.exit(2 if parsed is None else run_as_command(*parsed))
"""
TRANSFORMERS_BUILD = f"""
import torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM
with torch.device("meta"):
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({str(BUNDLED_MODEL_DIR)!r}))
"""
COMMANDS = ("bench", "chat", "convert", "finetune", "fit", "generate", "inspect", "make-model", "place", "record",
            "stats", "trace", "serve", "version")
GENERATE = ("generate", "--max-tokens", "8", "--temperature", "0", "Hello")
TORCH, TORCH_TRANSFORMERS = "python -c 'import torch'", "python -c 'import torch, transformers'"


@dataclass(frozen=True)
class Row:
    label: str
    argv: tuple[str, ...]  # after the interpreter
    kind: str  # "baseline" | "help" | "compute" | "generate"
    tree: Path | None = None  # the tiermoe source tree on PYTHONPATH (None: this one, as the caller set it)


@dataclass(frozen=True)
class Sample:
    total: float
    cpu: float  # user + system seconds of the process
    start: float | None  # None where the row has no probe (or the tree is older than the probe)
    start_cpu: float | None  # the CPU time the process had used by then
    first_output: float | None  # the first byte on stdout


def heat_file(work: Path) -> Path:
    """A statistics file `stats` reads without torch.save: 4 layers x 8 experts."""
    heat = work / "heat.csv"
    heat.write_text("layer," + ",".join(f"e{e}" for e in range(8)) + "\n"
                    + "".join(f"{layer}," + ",".join(str((layer + 1) * (e + 1)) for e in range(8)) + "\n"
                              for layer in range(4)))
    return heat


def rows(work: Path, trees: list[Path | None]) -> list[Row]:
    """The baselines, every command's --help and version, then for each tree the computing commands and generate."""
    heat = str(heat_file(work))
    out = [
        Row("python -c pass", ("-c", "pass"), "baseline"),
        Row(TORCH, ("-c", "import torch"), "baseline"),
        Row(TORCH_TRANSFORMERS, ("-c", "import torch, transformers"), "baseline"),
        Row("transformers builds the demo's model (meta)", ("-c", TRANSFORMERS_BUILD), "baseline"),
    ]
    main = ("-m", "tiermoe.cli.main")
    out += [Row("tiermoe --help", (*main, "--help"), "help"), Row("tiermoe --version", (*main, "--version"), "help"),
            Row("tiermoe version", (*main, "version"), "help")]
    out += [Row(f"tiermoe {name} --help", (*main, name, "--help"), "help") for name in COMMANDS]
    for tree in trees:
        at = "" if tree is None else f" @{tree.name}"
        probe = ("-c", PROBE)
        out += [
            Row(f"tiermoe place --num-layers 4 --num-experts 8{at}",
                (*probe, "place", "--num-layers", "4", "--num-experts", "8", "--num-gpu-experts", "2"), "compute", tree),
            Row(f"tiermoe place (demo model){at}", (*probe, "place", "--num-gpu-experts", "2"), "compute", tree),
            Row(f"tiermoe stats heat.csv{at}", (*probe, "stats", heat), "compute", tree),
            Row(f"tiermoe fit (demo model){at}", (*probe, "fit"), "compute", tree),
            Row(f"tiermoe inspect (demo model){at}", (*probe, "inspect"), "compute", tree),
            Row(f"tiermoe generate 'Hello' (demo model){at}", (*probe, *GENERATE), "generate", tree),
        ]
    return out


def child_env(tree: Path | None, pycache: Path | None) -> dict[str, str]:
    """The environment of a timed process: `tree` first on PYTHONPATH; bytecode kept under `pycache` (None: as the
    environment says)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


def timed(row: Row, cwd: Path, pycache: Path | None) -> Sample:
    env = child_env(row.tree, pycache)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    spawned, start = time.time(), time.perf_counter()
    proc = subprocess.Popen([sys.executable, *row.argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=cwd)
    errors: list[bytes] = []
    reader = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)
    reader.start()
    first = proc.stdout.read(1)
    first_output = time.perf_counter() - start if first else None
    proc.stdout.read()
    code = proc.wait()
    total = time.perf_counter() - start
    reader.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # one child at a time: the difference is this one's
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    stderr = errors[0].decode(errors="replace")
    if code not in (0, 1):  # fit says 1 when something does not fit: still a measured start
        raise SystemExit(f"{row.label} failed ({code}): {stderr.strip()[-500:]}")
    mark = re.search(rf"^{STARTED} (\S+) (\S+)$", stderr, re.MULTILINE)
    if mark is None:
        return Sample(total, cpu, None, None, first_output)
    return Sample(total, cpu, float(mark[1]) - spawned, float(mark[2]), first_output)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def verdict(row: Row, samples: list[Sample], budgets: dict[str, float]) -> str:
    budget = budgets.get(row.kind)
    if budget is None:
        return ""
    if row.kind == "help":
        figure, what = statistics.median(s.total for s in samples), "total"
    elif row.kind == "compute":
        total = "ok" if statistics.median(s.total for s in samples) <= budget else "OVER"
        if any(s.start is None for s in samples):
            return f"total {total} (< {budget:.2f} s)"
        start = "ok" if statistics.median(s.start for s in samples) <= budget else "OVER"
        return f"start {start}, total {total} (< {budget:.2f} s)"
    else:
        figure, what = statistics.median(s.first_output for s in samples), "first token"
    return f"{what} {'ok' if figure <= budget else 'OVER'} (< {budget:.2f} s)"


def print_table(table: list[Row], times: dict[str, list[Sample]], budgets: dict[str, float]) -> None:
    print(f"{'command':<52} {'start s':>17} {'start cpu s':>17} {'first token s':>17} {'total s':>17} "
          f"{'total cpu s':>17}  target")
    for row in table:
        samples = times[row.label]
        probed = all(s.start is not None for s in samples)
        start = spread([s.start for s in samples]) if probed else "-"
        start_cpu = spread([s.start_cpu for s in samples]) if probed else "-"
        first = "-"
        if row.kind == "generate" and all(s.first_output is not None for s in samples):
            first = spread([s.first_output for s in samples])
        total, cpu = spread([s.total for s in samples]), spread([s.cpu for s in samples])
        print(f"{row.label:<52} {start:>17} {start_cpu:>17} {first:>17} {total:>17} {cpu:>17}  "
              f"{verdict(row, samples, budgets)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="runs of each command (default 5, at least 5)")
    parser.add_argument("--compare-tree", type=Path, action="append", default=[], metavar="DIR",
                        help="also time the commands of the tiermoe source tree DIR (on PYTHONPATH), alternating")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="leave PYTHONDONTWRITEBYTECODE as it is and keep no warm-up round")
    parser.add_argument("--json", help="also write every time to this file")
    args = parser.parse_args()
    if not 5 <= args.rounds <= 1000:
        parser.error(f"--rounds: expected 5 to 1000 rounds, got {args.rounds}")
    for tree in args.compare_tree:
        if not (tree / "tiermoe" / "cli" / "main.py").is_file():
            parser.error(f"--compare-tree {tree}: expected a tiermoe source tree (tiermoe/cli/main.py in it)")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "cwd").mkdir()
        pycache = None if args.no_bytecode_cache else work / "pycache"
        table = rows(work, [None, *(t.resolve() for t in args.compare_tree)])
        times: dict[str, list[Sample]] = {row.label: [] for row in table}
        for round_ in range(args.rounds + (pycache is not None)):
            for row in table:
                sample = timed(row, work / "cwd", pycache)
                if pycache is None or round_ > 0:  # round 0 fills the bytecode cache
                    times[row.label].append(sample)
    torch_s = statistics.median(s.total for s in times[TORCH])
    transformers_s = statistics.median(s.total for s in times[TORCH_TRANSFORMERS])
    budgets = {"help": HELP_BUDGET_S, "compute": torch_s + COMPUTE_MARGIN_S,
               "generate": transformers_s + FIRST_TOKEN_MARGIN_S}
    print_table(table, times, budgets)
    bytecode = "compiled every time" if args.no_bytecode_cache else "bytecode cached"
    print(f"\n{args.rounds} rounds, medians (min-max); {sys.executable}; {bytecode}; load average after: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\ntargets: --help and version {HELP_BUDGET_S} s; computing "
          f"commands' start the torch import ({torch_s:.2f} s) + {COMPUTE_MARGIN_S} s; generate's first token the "
          f"torch + transformers import ({transformers_s:.2f} s) + {FIRST_TOKEN_MARGIN_S} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "seconds": {
            label: [asdict(s) for s in samples] for label, samples in times.items()}}, indent=1))


if __name__ == "__main__":
    main()
