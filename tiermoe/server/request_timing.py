"""When one request reached each stage of its generation (time.monotonic() seconds), for the replies that report
durations (Ollama's final record). The engine thread records them; the last event of a request carries them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTiming:
    started: float | None  # the start of the step that fed its first prompt chunk (None: never admitted)
    first_token: float | None  # its first token was sampled
    last_token: float | None  # its last token was sampled
