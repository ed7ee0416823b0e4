"""Server counters, rendered in the Prometheus text format for /metrics.

Owned by the app (one per server), updated by the engine thread and the request handlers.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class ServerMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests_total = 0
        self.requests_failed = 0
        self.requests_aborted = 0
        self.requests_refused = 0
        self.requests_timed_out = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) over the last window

    def add(self, **counts) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1

    def observe_tokens(self, tokens: int, window: float = 10.0) -> None:
        now = time.monotonic()
        with self._lock:
            self.generation_tokens += tokens
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - window:
                self._recent.popleft()

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [n for t, n in self._recent if t >= now - window]
        return sum(recent) / window

    def render(self, gauges: dict[str, float | None]) -> str:
        lines = []

        def metric(name: str, kind: str, help_text: str, value) -> None:
            if value is None:
                return
            lines.extend([f"# HELP tiermoe_{name} {help_text}", f"# TYPE tiermoe_{name} {kind}",
                          f"tiermoe_{name} {value}"])

        metric("requests_total", "counter", "Requests received.", self.requests_total)
        metric("requests_failed_total", "counter", "Requests that ended in an error.", self.requests_failed)
        metric("requests_aborted_total", "counter", "Requests whose client went away.", self.requests_aborted)
        metric("requests_refused_total", "counter", "Requests refused once their body arrived (503): the running and "
               "queued ones filled --max-running-requests + --max-queued-requests.", self.requests_refused)
        metric("requests_timed_out_total", "counter", "Requests stopped by --request-timeout.",
               self.requests_timed_out)
        metric("prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens)
        metric("generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens)
        metric("generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
               round(self.tokens_per_second(), 3))
        metric("time_to_first_token_seconds_sum", "counter", "Sum of times to first token.", round(self.ttft_sum, 6))
        metric("time_to_first_token_seconds_count", "counter", "Requests with a first token.", self.ttft_count)
        for name, value in gauges.items():
            metric(name, "gauge", name.replace("_", " ").capitalize() + ".", value)
        return "\n".join(lines) + "\n"
