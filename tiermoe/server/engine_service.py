"""The engine on its own thread, fed by asyncio request handlers.

Handlers never touch the Engine: they post commands (add, abort) to a queue that the engine thread applies
between steps, and read token events from a per-request asyncio queue that the engine thread fills with
`call_soon_threadsafe`. So the event loop is never blocked by a forward pass, and the engine needs no locks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from tiermoe.engine.sampling import SamplingParams
from tiermoe.engine.sequence import Sequence
from tiermoe.server.metrics import ServerMetrics
from tiermoe.engine.text_stream import TextStream


@dataclass
class Event:
    """A piece of one request's output: new text (and ids); `finish_reason` set on the last event."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class RequestHandle:
    prompt_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    created: float = field(default_factory=time.monotonic)
    seq: Sequence | None = None
    stream: TextStream | None = None
    sent_ids: int = 0
    first_token_at: float | None = None
    done: bool = False

    def push(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineService:
    def __init__(self, engine, detokenize, metrics: ServerMetrics, idle_wait: float = 0.05):
        self.engine = engine
        self.detokenize = detokenize
        self.metrics = metrics
        self.idle_wait = idle_wait
        self._commands: queue.Queue = queue.Queue()
        self._handles: dict[int, RequestHandle] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiermoe-engine", daemon=True)
        self.steps = 0

    # --- called from the event loop -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the running requests finish (drain), or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (self._handles or not self._commands.empty()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=5)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        handle = RequestHandle(prompt_ids, params, asyncio.Queue(), asyncio.get_running_loop())
        self.metrics.add(requests_total=1)
        self._commands.put(("add", handle))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        if not handle.done:
            self._commands.put(("abort", handle))

    @property
    def queue_length(self) -> int:
        return len(self.engine.waiting)

    @property
    def running(self) -> int:
        return len(self.engine.running)

    # --- the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._apply_commands(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                produced = self.engine.step()
            except Exception as err:  # noqa: BLE001 - one failing step must not kill the server
                self._fail_all(f"{type(err).__name__}: {err}")
                continue
            self.steps += 1
            for seq in produced:
                self._emit(seq)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self.idle_wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, handle = command
            if kind == "add":
                self._add(handle)
            elif handle.seq is not None and not handle.done:
                self.engine.abort(handle.seq)
                self._finish(handle)
                self.metrics.add(requests_aborted=1)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, handle: RequestHandle) -> None:
        try:
            handle.seq = self.engine.add(handle.prompt_ids, handle.params)
        except Exception as err:  # noqa: BLE001 - reported to the client as an error event
            handle.done = True
            handle.push(Event("", [], "error", error=str(err)))
            self.metrics.add(requests_failed=1)
            return
        handle.stream = TextStream(self.detokenize, handle.params.stop) if self.detokenize else None
        self._handles[handle.seq.seq_id] = handle
        self.metrics.add(prompt_tokens=len(handle.prompt_ids))

    def _emit(self, seq: Sequence) -> None:
        handle = self._handles.get(seq.seq_id)
        if handle is None:
            return
        if handle.first_token_at is None:
            handle.first_token_at = time.monotonic()
            self.metrics.observe_ttft(handle.first_token_at - handle.created)
        new_ids = seq.output_ids[handle.sent_ids:]
        handle.sent_ids = len(seq.output_ids)
        self.metrics.observe_tokens(len(new_ids))
        text = handle.stream.delta(seq.output_ids, seq.finished, seq.stop_text_end) if handle.stream else ""
        handle.push(Event(text, new_ids, seq.finish_reason))
        if seq.finished:
            self._finish(handle)

    def _finish(self, handle: RequestHandle) -> None:
        handle.done = True
        self._handles.pop(handle.seq.seq_id, None)

    def _fail_all(self, message: str) -> None:
        for handle in list(self._handles.values()):
            self.engine.abort(handle.seq)
            handle.push(Event("", [], "error", error=message))
            self._finish(handle)
            self.metrics.add(requests_failed=1)
