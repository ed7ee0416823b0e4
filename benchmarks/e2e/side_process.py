"""A side of a benchmark in a process of its own (e2e/worker.py runs it): the client end of worker.py's protocol.
bench_e2e_cpu.py runs tiermoe and llama.cpp this way, bench_speculative.py its llama.cpp arms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "worker.py"


class Worker:
    """A side in its own process (e2e/worker.py); call(op, **kwargs) runs one request and returns its result."""

    def __init__(self, label: str, backend: str, args: dict, pythonpath: Path | None):
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(pythonpath)] + [p for p in [env.get("PYTHONPATH")] if p])
        self.label = label
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        try:
            self.layers = self.call("load", backend=backend, args=args)["layers"]
        except SideError:
            self.close()
            raise

    def call(self, op: str, **kwargs):
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SideError(f"{self.label}: its process ended (exit status {self.proc.wait()}); see its output above")
        reply = json.loads(line)
        if "error" in reply:
            raise SideError(f"{self.label} {op}: {reply['error']}")
        return reply["ok"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        self.proc.wait()


class SideError(Exception):
    pass
