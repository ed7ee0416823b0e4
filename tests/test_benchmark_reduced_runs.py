"""`benchmarks/reduced_runs.sh --list` names every `benchmarks/*.py`: as a run whose command calls it, or as skipped
with a reason. A new benchmark without a reduced-size run fails here.

Only the list is read (it starts no benchmark); running the reduced runs themselves takes minutes and is done by
hand: `benchmarks/reduced_runs.sh`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "reduced_runs.sh"


def listed_runs() -> dict[str, str]:
    done = subprocess.run(["bash", str(SCRIPT), "--list"], check=False, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    runs = {}
    for line in done.stdout.splitlines():
        name, sep, command = line.partition("\t")
        assert sep and name not in runs, f"not one run per line, or a name twice: {line!r}"
        runs[name] = command
    return runs


def test_every_benchmark_has_a_reduced_run_or_a_reason_to_skip():
    runs = listed_runs()
    missing, unexplained = [], []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        command = runs.get(script.stem)
        if command is None:
            missing.append(script.name)
        elif command.startswith("skipped:"):
            if not command.removeprefix("skipped:").strip():
                unexplained.append(script.name)
        elif f"benchmarks/{script.name}" not in command:
            missing.append(f"{script.name} (its run does not call it: {command[:80]})")
    assert not missing, f"benchmarks without a reduced run in benchmarks/reduced_runs.sh: {missing}"
    assert not unexplained, f"benchmarks skipped without a reason: {unexplained}"
