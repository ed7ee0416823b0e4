"""The resident memory of a process and its children (a server with ranks is several processes), sampled on a
thread at a fixed interval."""

from __future__ import annotations

import threading
import time

import psutil


def tree_rss(proc: psutil.Process) -> int:
    """RSS of `proc` and all its descendants, in bytes (those that exit while being read count as 0)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class RssSampler:
    """(monotonic time, RSS bytes) every `interval` seconds, from start() to stop()."""

    def __init__(self, proc: psutil.Process, interval: float = 1.0):
        self.proc, self.interval = proc, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), tree_rss(self.proc)))
            self._stop.wait(self.interval)

    def at(self, when: float) -> int:
        """The sample taken nearest to monotonic time `when`."""
        return min(self.samples, key=lambda sample: abs(sample[0] - when))[1]
