"""SGLang's decode-batch log line, so a server's speed shows in its log as it does in SGLang's:

    Decode batch. #running-req: 3, #token: 448, token usage: 0.02, gen throughput (token/s): 41.87, #queue-req: 0

one line every `--decode-log-interval` decode steps (steps that generated tokens; 0: never). The throughput is
measured over the interval: the tokens its steps generated over the time the engine was busy since the previous line
(prefill-only steps included, as SGLang counts them; idle time left out, so a quiet server is not reported slow).
The counts are those of the interval's last step: the sequences it ran (as SGLang counts its batch: those that
finished in it too), those waiting, and the KV pool's full-attention pages in use after it (as tokens, and as a
share of the pool).
"""

from __future__ import annotations

import logging

from tiermoe.errors import TiermoeError

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 40  # SGLang's --decode-log-interval default


def kv_usage(engine) -> tuple[int, float]:
    """(tokens the running sequences hold in the KV pool's full-attention pages, the share of those pages used)."""
    pool = engine.pool
    used, total = pool.used_pages().get(None, 0), pool.pages.num_pages.get(None, 0)
    return used * pool.page_size, used / total if total else 0.0


def decode_batch_line(running: int, tokens: int, usage: float, throughput: float, queued: int) -> str:
    return (f"Decode batch. #running-req: {running}, #token: {tokens}, token usage: {usage:.2f}, "
            f"gen throughput (token/s): {throughput:.2f}, #queue-req: {queued}")


class DecodeLog:
    """Counts the engine's steps (on the engine thread) and logs the decode-batch line once per interval."""

    def __init__(self, interval: int = DEFAULT_INTERVAL):
        if interval < 0:
            raise TiermoeError(f"--decode-log-interval must be >= 0 (0: never), got {interval}")
        self.interval = interval
        self._steps = 0  # decode steps in this interval
        self._tokens = 0  # tokens they generated
        self._seconds = 0.0  # busy time since the previous line

    def after_step(self, tokens: int, seconds: float, engine, finished: int = 0) -> str | None:
        """Count one step that generated `tokens` and took `seconds` (since the previous busy step ended), and in
        which `finished` sequences ended; returns the line it logged, when this step ends an interval."""
        if not self.interval:
            return None
        self._seconds += seconds
        if not tokens:
            return None
        self._steps += 1
        self._tokens += tokens
        if self._steps < self.interval:
            return None
        throughput = self._tokens / self._seconds if self._seconds > 0 else 0.0
        line = decode_batch_line(len(engine.running) + finished, *kv_usage(engine), throughput, len(engine.waiting))
        self._steps, self._tokens, self._seconds = 0, 0, 0.0
        log.info(line)
        return line
