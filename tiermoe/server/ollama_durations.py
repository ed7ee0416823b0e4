"""The durations Ollama's final record carries (`total_duration`, `load_duration`, `prompt_eval_duration`,
`eval_duration`, in nanoseconds), measured per request:

- total_duration: from the handler's start to the final record;
- load_duration: until the engine started on the prompt. The model stays loaded, so this is the wait for a turn (the
  tokenizer and chat template, then the queue when every slot is running), where Ollama waits for its runner;
- prompt_eval_duration: from there to the first token (the prompt's prefill, in chunks beside other requests' steps);
- eval_duration: from the first token to the last, as Ollama measures it (its eval_count counts every generated token).

A stage never reached (a request that failed or stopped early) ends where the next began, or at the final record.
"""

from __future__ import annotations

from tiermoe.server.request_timing import RequestTiming


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def ollama_durations(arrived: float, timing: RequestTiming | None, now: float) -> dict[str, int]:
    """`arrived`, `now`: time.monotonic() at the handler's start and at the final record."""
    started = timing.started if timing is not None and timing.started is not None else now
    first = timing.first_token if timing is not None and timing.first_token is not None else now
    last = timing.last_token if timing is not None and timing.last_token is not None else first
    return {"total_duration": _ns(now - arrived), "load_duration": _ns(started - arrived),
            "prompt_eval_duration": _ns(first - started), "eval_duration": _ns(last - first)}
