"""Every `benchmarks/*.py` is a command with `--help` (usage, exit 0); their shared parts live in benchmarks/e2e/,
benchmarks/soak/ and benchmarks/support/.

One child process runs each script's `--help` in turn (runpy, as `python benchmarks/X.py --help` would, its folder
first on sys.path): torch and the libraries are imported once rather than once per script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

DRIVER = r"""
import contextlib, io, json, runpy, sys
from pathlib import Path

folder = Path(sys.argv[1])
sys.path.insert(0, str(folder))
results = {}
for path in sorted(folder.glob("*.py")):
    printed = io.StringIO()
    sys.argv = [str(path), "--help"]
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            runpy.run_path(str(path), run_name="__main__")
        status = "returned without printing usage and exiting"
    except SystemExit as exit:
        status = exit.code or 0
    except BaseException as err:
        status = f"{type(err).__name__}: {err}"
    results[path.name] = [status, printed.getvalue()]
print(json.dumps(results))
"""


def test_every_benchmark_script_answers_help():
    done = subprocess.run([sys.executable, "-c", DRIVER, str(BENCHMARKS)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    assert set(results) == scripts and len(scripts) > 30
    bad = {name: (status, printed[-300:]) for name, (status, printed) in results.items()
           if status != 0 or "usage:" not in printed}
    assert not bad, f"benchmarks whose --help fails: {bad}"
