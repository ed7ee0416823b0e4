"""The engine on its own thread, fed by asyncio request handlers.

Handlers never touch the Engine: they post commands (add, abort) to a queue that the engine thread applies
between steps, and read token events from a per-request asyncio queue that the engine thread fills with
`call_soon_threadsafe`. So the event loop is never blocked by a forward pass, and the engine needs no locks.

A sequence that fails inside a step (the engine isolates it: tiermoe.engine.engine) ends its request with an
error event; the others go on. A step that fails as a whole fails its requests and the service goes on, unless
the error is fatal (`fatal = True` somewhere in its cause chain, e.g. a rank of a multi-rank run died; or a sticky
CUDA error, tiermoe.engine.device_errors): then every request fails, the engine thread stops, and `on_fatal(err)`
lets the server exit with that error instead of serving from a broken process group or a poisoned GPU. An error
that escapes the engine thread's loop anywhere else (emitting a token, applying a command) takes the same exit:
a dead engine thread must not leave a server that answers /health and never replies. `healthy` says which.

`--watchdog-timeout S` (SGLang's flag): a step that runs longer than S seconds (a hung kernel, a deadlocked CPU
tier) is treated the same way, from a watchdog thread, since the stuck engine thread cannot notice it itself: one
error line in the log, every request fails, and the server exits with that error (SGLang kills its process).

The engine thread also keeps what the server reports of its speed: each request's timing (when its prompt started,
its first and last token: tiermoe.server.request_timing, on its last event) and SGLang's decode-batch log line
(tiermoe.server.decode_log).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from tiermoe.engine.device_errors import device_lost, sticky_device_error
from tiermoe.engine.logprobs import TokenLogprob
from tiermoe.engine.sampling import SamplingParams
from tiermoe.engine.sequence import Sequence
from tiermoe.engine.text_stream import TextStream
from tiermoe.errors import TiermoeError, cause_chain
from tiermoe.server.decode_log import DecodeLog
from tiermoe.server.metrics import ServerMetrics
from tiermoe.server.request_timing import RequestTiming

log = logging.getLogger(__name__)


class StuckStepError(TiermoeError):
    """An engine step ran past --watchdog-timeout: the engine cannot be trusted to go on."""

    fatal = True


class EngineThreadDied(TiermoeError):
    """An error escaped the engine thread's loop: nothing would serve the requests."""

    fatal = True


@dataclass
class Event:
    """A piece of one request's output: new text (and ids); `finish_reason` set on the last event. An error
    ends the request with finish_reason "error"; `client_error` when the request's own values caused it, `status`
    when another HTTP status says what happened (504: --request-timeout). `logprobs`: one per new id, when the
    request asked; `prompt_logprobs` on the first event, when asked."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    client_error: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    status: int | None = None
    stop_string: str | None = None  # on the last event: the stop string the answer ended before, if one did
    timing: RequestTiming | None = None  # on the last event of a request that ran in the engine

    @property
    def error_status(self) -> int:
        """The HTTP status of an error: `status`, else 400 when the request caused it, else 500."""
        return self.status or (400 if self.client_error else 500)


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
    started_at: float | None = None  # the start of the step that fed its first prompt chunk
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: bool = False
    timed_out: bool = False  # stopped by --request-timeout (counted as that, not as aborted by its client)
    group: int | None = None  # the request it belongs to (Engine.add)

    def push(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def timing(self) -> RequestTiming:
        return RequestTiming(self.started_at, self.first_token_at, self.last_token_at)


class EngineService:
    def __init__(self, engine, metrics: ServerMetrics, idle_wait: float = 0.05, watchdog_timeout: float | None = None,
                 decode_log: DecodeLog | None = None):
        self.engine = engine
        self.metrics = metrics
        self.idle_wait = idle_wait
        self._commands: queue.Queue = queue.Queue()
        self._handles: dict[int, RequestHandle] = {}
        self._unstarted: dict[int, RequestHandle] = {}  # handles whose prompt the engine has not started on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiermoe-engine", daemon=True)
        self.steps = 0
        self.on_fatal = None  # callable(err): the engine cannot go on (set by the server)
        self.fatal_error: BaseException | None = None
        self.watchdog_timeout = watchdog_timeout
        self._step_started: float | None = None  # time.monotonic() when the running step began; None between steps
        self._fatal_lock = threading.Lock()  # the engine thread and the watchdog may both give up at once
        self.decode_log = decode_log or DecodeLog(0)
        self._busy_since: float | None = None  # when the previous step ended, while the engine has kept busy

    # --- called from the event loop -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        if self.watchdog_timeout is not None:
            threading.Thread(target=self._watch, name="tiermoe-watchdog", daemon=True).start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the running requests finish (drain), or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (self._handles or not self._commands.empty()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=5)

    def submit(self, prompt_ids: list[int], params: SamplingParams, group: int | None = None) -> RequestHandle:
        """Queue a prompt for the engine; `group`: the request it belongs to (a batch's prompts share one: the
        engine admits round-robin across requests)."""
        handle = RequestHandle(prompt_ids, params, asyncio.Queue(), asyncio.get_running_loop(), group=group)
        self.metrics.add(requests_total=1)
        if self.fatal_error is not None:  # the engine thread is gone: fail now instead of waiting forever
            handle.done = True
            handle.push(Event("", [], "error", error=str(self.fatal_error)))
            return handle
        self._commands.put(("add", handle))
        return handle

    async def between_steps(self, fn):
        """Run `fn()` on the engine thread between two steps (e.g. recorder start/stop/dump) and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (fn, future)))
        return await asyncio.wrap_future(future)

    def abort(self, handle: RequestHandle, timed_out: bool = False) -> None:
        handle.timed_out = handle.timed_out or timed_out  # set before the command: the engine thread reads it
        if not handle.done:
            self._commands.put(("abort", handle))

    def fail(self, err: BaseException) -> None:
        """From any thread: the engine cannot go on (e.g. a rank died while idle); stop as after a fatal step."""
        self._commands.put(("fatal", err))

    @property
    def queue_length(self) -> int:
        return len(self.engine.waiting)

    @property
    def running(self) -> int:
        return len(self.engine.running)

    @property
    def healthy(self) -> bool:
        """Whether requests can still be served: the engine thread runs and has not stopped for good."""
        return self.fatal_error is None and self._thread.is_alive()

    # --- the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve_steps()
        except Exception as err:  # noqa: BLE001 - the one exit path: fail every request, let the server exit
            log.error("the engine thread stopped: %s: %s", type(err).__name__, err, exc_info=err)
            self._stop_for_good(EngineThreadDied(f"the engine thread stopped ({type(err).__name__}: {err}); "
                                                 "every request in flight failed"))

    def _serve_steps(self) -> None:
        while not self._stop.is_set():
            self._apply_commands(block=not self.engine.has_work())
            if not self.engine.has_work():
                self._busy_since = None
                continue
            started = self._step_started = time.monotonic()
            try:
                produced = self.engine.step()
            except Exception as err:  # noqa: BLE001 - one failing step must not kill the server
                fatal = _fatal(err)
                if fatal is not None:
                    self._stop_for_good(fatal)
                    return
                self._fail_all(f"{type(err).__name__}: {err}")
                continue
            finally:
                self._step_started = None
            if self._stop.is_set():  # the watchdog gave up on this step meanwhile: its requests have failed
                return
            self.steps += 1
            self._mark_started(started)
            tokens = sum(self._emit(seq) for seq in produced)
            ended = time.monotonic()
            self.decode_log.after_step(tokens, ended - (self._busy_since or started), self.engine,
                                       finished=sum(seq.finished for seq in produced))
            self._busy_since = ended

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self.idle_wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, handle = command
            if kind == "fatal":
                self._stop_for_good(handle)
                return
            if kind == "add":
                self._add(handle)
            elif kind == "call":
                fn, future = handle
                try:
                    future.set_result(fn())
                except Exception as err:  # noqa: BLE001 - handed back to the caller
                    future.set_exception(err)
            elif handle.seq is not None and not handle.done:
                self.engine.abort(handle.seq)
                self._finish(handle)
                if not handle.timed_out:
                    self.metrics.add(requests_aborted=1)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, handle: RequestHandle) -> None:
        try:
            handle.seq = self.engine.add(handle.prompt_ids, handle.params, group=handle.group)
        except Exception as err:  # noqa: BLE001 - reported to the client as an error event
            handle.done = True
            handle.push(Event("", [], "error", error=str(err), client_error=isinstance(err, TiermoeError)))
            self.metrics.add(requests_failed=1)
            return
        # text (the engine's: its stop strings are searched in it) when the engine has a tokenizer
        handle.stream = TextStream(self.engine.decoded_text(handle.seq), handle.params.stop) \
            if self.engine.detokenize is not None else None
        self._handles[handle.seq.seq_id] = handle
        self._unstarted[handle.seq.seq_id] = handle
        self.metrics.add(prompt_tokens=len(handle.prompt_ids))

    def _mark_started(self, step_started: float) -> None:
        """Requests whose first prompt chunk went through the step that began at `step_started`."""
        for seq_id, handle in list(self._unstarted.items()):
            if handle.seq.num_fed or handle.seq.finished:
                handle.started_at = step_started
                del self._unstarted[seq_id]

    def _emit(self, seq: Sequence) -> int:
        """Hands the sequence's new output to its request; returns how many tokens it generated."""
        handle = self._handles.get(seq.seq_id)
        if handle is None:
            return 0
        now = time.monotonic()
        first = handle.first_token_at is None
        if first:
            handle.first_token_at = now
            self.metrics.observe_ttft(handle.first_token_at - handle.created)
        sent = handle.sent_ids
        new_ids = seq.output_ids[sent:]
        handle.sent_ids = len(seq.output_ids)
        if new_ids:
            handle.last_token_at = now
        self.metrics.observe_tokens(len(new_ids))
        text = handle.stream.delta(seq.output_ids, seq.finished, seq.stop_text_end) if handle.stream else ""
        prompt_scores = list(seq.prompt_logprobs) if first and seq.params.prompt_logprobs is not None else None
        handle.push(Event(text, new_ids, seq.finish_reason, error=seq.error, client_error=seq.error_from_request,
                          logprobs=seq.output_logprobs[sent:], prompt_logprobs=prompt_scores,
                          stop_string=seq.stop_string, timing=handle.timing() if seq.finished else None))
        if seq.finished:
            self._finish(handle)
            if seq.error is not None:
                self.metrics.add(requests_failed=1)
        return len(new_ids)

    def _finish(self, handle: RequestHandle) -> None:
        handle.done = True
        self._handles.pop(handle.seq.seq_id, None)
        self._unstarted.pop(handle.seq.seq_id, None)

    def _watch(self) -> None:
        """The watchdog thread: gives up on a step that runs past watchdog_timeout."""
        timeout = self.watchdog_timeout
        while not self._stop.wait(min(1.0, timeout / 10)):
            started = self._step_started
            if started is not None and time.monotonic() - started > timeout:
                err = StuckStepError(f"an engine step ran for more than --watchdog-timeout {timeout:g} s; the "
                                     "server stops (every request failed)")
                log.error("watchdog: %s", err)
                self._stop_for_good(err, engine_is_free=False)
                return

    def _stop_for_good(self, err: BaseException, engine_is_free: bool = True) -> None:
        """Fail every request and stop for good. From the watchdog the engine is inside a step (another thread's):
        it is left alone, and the requests fail without it."""
        with self._fatal_lock:
            if self.fatal_error is not None:
                return
            self.fatal_error = err
        self._stop.set()
        self._fail_all(str(err), engine_is_free)
        while True:  # requests that arrive from now on fail at once
            try:
                kind, handle = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                handle.done = True
                handle.push(Event("", [], "error", error=str(err)))
        if self.on_fatal is not None:
            self.on_fatal(err)

    def _fail_all(self, message: str, engine_is_free: bool = True) -> None:
        for handle in list(self._handles.values()):
            if engine_is_free:
                self.engine.abort(handle.seq)
            handle.push(Event("", [], "error", error=message))
            self._finish(handle)
            self.metrics.add(requests_failed=1)


def _fatal(err: BaseException | None) -> BaseException | None:
    """The error in `err`'s cause chain that marks the engine unusable (`fatal = True`, or a sticky device error
    raised outside the step's isolation), if any."""
    sticky = sticky_device_error(err)
    if sticky is not None and not getattr(err, "fatal", False):
        return device_lost(sticky)
    return next((e for e in cause_chain(err) if getattr(e, "fatal", False)), None)
