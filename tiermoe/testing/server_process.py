"""Start a real `tiermoe serve` process on a free loopback port (tests and benchmarks use it).

The server's output is read on a thread from the start, keeping the last lines (`log_tail()`): a pipe left
unread fills with access-log lines after a few hundred requests and the server then blocks writing the next one.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time

import httpx

from tiermoe.distributed.launch import free_port


class ServerProcess:
    def __init__(self, model_dir, *flags: str, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiermoe.cli.main", "serve", "--model", str(model_dir), "--port", str(self.port),
             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self._tail: collections.deque[str] = collections.deque(maxlen=200)
        self._reader = threading.Thread(target=self._tail.extend, args=(self.proc.stdout,), name="server-log",
                                        daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not answer /health within {timeout:.0f} s (a first run builds the native "
                           f"kernels, about 90 s); its output:\n{self.log_tail()}")

    def log_tail(self) -> str:
        """The last lines the server printed (all of them once it has exited)."""
        if self.proc.poll() is not None:
            self._reader.join(timeout=5)
        return "".join(self._tail)

    def stop(self, sig=None) -> int:
        if self.proc.poll() is None:
            self.proc.terminate() if sig is None else self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
