"""Runs the GPU check's plan: one check after another, each within its budget, each result on disk at once.

After every check its result is appended to gpu_check.jsonl and gpu_check.json is rewritten whole (atomically),
so a run cut short (its last check hung, the call's time ran out) still returns everything learnt before.
A check runs in its own process (tiermoe.analysis.gpu_check.child) unless `in_process` (a rehearsal on a
machine without CUDA, where isolation buys nothing and each process would load torch again). Standard library
only: the checks import torch in their own processes.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tiermoe.analysis.gpu_check.child import run_check
from tiermoe.analysis.gpu_check.plan import Check, CheckContext

KILL_GRACE_S = 10  # after its deadline a check's process gets this long to dump its stacks before it is killed
MIN_USEFUL_S = 10  # a check left fewer seconds than this (and than its budget) is skipped, not started
FAILED = ("fail", "timeout")


class ResultLog:
    """gpu_check.jsonl (one line per finished check) and gpu_check.json (the report so far) in `out_dir`."""

    def __init__(self, out_dir: Path, header: dict):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.lines = self.out_dir / "gpu_check.jsonl"
        self.report_path = self.out_dir / "gpu_check.json"
        self.report = {**header, "checks": {}, "failed": [], "complete": False}
        self.lines.write_text("")
        self._write_report()

    def add(self, name: str, result: dict) -> None:
        self.report["checks"][name] = result
        self.report["failed"] = [k for k, v in self.report["checks"].items() if v.get("status") in FAILED]
        with self.lines.open("a") as f:
            f.write(json.dumps({"check": name, **result}, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._write_report()

    def finish(self, seconds: float) -> dict:
        self.report["complete"] = True
        self.report["seconds"] = round(seconds, 1)
        self._write_report()
        return self.report

    def _write_report(self) -> None:
        tmp = self.report_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        os.replace(tmp, self.report_path)


def run_in_child(check: Check, ctx: CheckContext) -> dict:
    """The check in its own process (stdout and stderr shared: they stream into the log)."""
    fd, result_path = tempfile.mkstemp(prefix="gpu-check-result-", suffix=".json")
    os.close(fd)
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "tiermoe.analysis.gpu_check.child", "--target", check.target,
                             "--context", ctx.to_json(), "--result", result_path])
    try:
        code = proc.wait(timeout=max(1.0, ctx.deadline - time.time()) + KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    elapsed = time.time() - start
    try:
        text = Path(result_path).read_text()
    finally:
        Path(result_path).unlink(missing_ok=True)
    if text:
        return json.loads(text)
    budget = ctx.deadline - start
    if elapsed >= budget - 0.5:
        return {"status": "timeout", "error": f"overran its budget of {budget:.0f} s: stopped; the stack of every "
                                              "thread at that moment is in the log"}
    return {"status": "fail", "error": f"its process ended with exit code {code} and no result (a crash: see the "
                                       "log for the stack)"}


def run_here(check: Check, ctx: CheckContext) -> dict:
    """The check in this process: an overrun is only reported (stacks in the log), never stopped."""
    faulthandler.dump_traceback_later(max(1.0, ctx.deadline - time.time()), exit=False)
    try:
        return run_check(check.target, ctx)
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_plan(checks: tuple[Check, ...], base: CheckContext, results: ResultLog, deadline: float,
             skip_reason: str | None = None, in_process: bool = False,
             log: Callable[[str], None] = print) -> dict:
    """Run `checks` in order (or mark each skipped with `skip_reason`), no later than `deadline` (time.time())."""
    started = time.time()
    execute = run_here if in_process else run_in_child
    for i, check in enumerate(checks, 1):
        head = f"[gpu-check] {i}/{len(checks)} {check.name}"
        left = deadline - time.time()
        budget = min(check.budget_s, left)
        if skip_reason:
            result = {"status": "skipped", "reason": skip_reason}
        elif budget < min(check.budget_s, MIN_USEFUL_S):
            result = {"status": "skipped", "reason": f"time budget spent ({max(0.0, left):.0f} s left of the run)"}
        else:
            log(f"{head} (budget {budget:.0f} s): {check.shows}")
            t0 = time.time()
            result = execute(check, dataclasses.replace(base, deadline=t0 + budget))
            result["seconds"] = round(time.time() - t0, 1)
            result["budget_s"] = round(budget, 1)
        results.add(check.name, result)
        log(f"{head}: {describe(result)}")
    return results.finish(time.time() - started)


def describe(result: dict) -> str:
    text = result.get("status", "?")
    if "reason" in result:
        text += f": {result['reason']}"
    if "error" in result:
        text += f" - {result['error']}"
    if "seconds" in result:
        text += f" [{result['seconds']} s]"
    return text
