"""Running one request through the engine service: as a stream of events, or collected into one result.

With --request-timeout, a request that has been in the engine (queued or generating) that long is stopped: the
engine aborts it between two steps and its client gets an error, 504 Gateway Timeout (the server's own
generation, behind the HTTP front, did not answer in time; 408 Request Timeout would say the client was too slow
to send its request), or, once streaming, an error event with finish_reason "error" like any failed generation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request

from tiermoe.engine.logprobs import TokenLogprob
from tiermoe.engine.sampling import SamplingParams
from tiermoe.server.engine_service import Event
from tiermoe.server.request_timing import RequestTiming
from tiermoe.server.state import ServerState


class GenerationFailed(RuntimeError):
    """The engine reported an error for this request, with its HTTP status (Event.error_status)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass
class Collected:
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked
    prompt_logprobs: list[TokenLogprob] | None = None  # when asked
    stop_string: str | None = None  # the stop string the answer ended before, if one did
    timing: RequestTiming | None = None  # when it reached each stage (the engine's last event)


async def stream_events(state: ServerState, request: Request, prompt_ids: list[int],
                        params: SamplingParams) -> AsyncIterator[Event]:
    """Events until the last one (an error is an event too: `error` set, finish_reason "error"; a stream says so
    to its client). If the client goes away (the connection closes, or the consumer is cancelled), the request
    is aborted at once, streaming or not: the engine frees its slot between the next two steps. Past
    --request-timeout it is aborted the same way, and the last event is an error with status 504."""
    handle = state.service.submit(prompt_ids, params, group=id(request))  # a batch's prompts: one request
    timeout = state.config.request_timeout
    deadline = None if timeout is None else handle.created + timeout
    watcher = asyncio.create_task(_on_disconnect(request, lambda: handle.events.put_nowait(DISCONNECTED)))
    try:
        while True:
            try:
                event = await _next_event(handle.events, deadline)
            except TimeoutError:
                state.service.abort(handle, timed_out=True)
                state.metrics.add(requests_timed_out=1)
                yield Event("", [], "error", status=504, error=f"the request took longer than the server's "
                            f"--request-timeout ({timeout:g} s) and was stopped")
                return
            if event is DISCONNECTED:
                return
            yield event
            if event.finish_reason is not None:
                return
    finally:
        watcher.cancel()
        state.service.abort(handle)


DISCONNECTED = object()  # put in a request's event queue when its client has gone


async def _next_event(events: asyncio.Queue, deadline: float | None):
    """The next event, or TimeoutError once `deadline` (time.monotonic) has passed."""
    if deadline is None:
        return await events.get()
    return await asyncio.wait_for(events.get(), max(0.0, deadline - time.monotonic()))


async def _on_disconnect(request: Request, then) -> None:
    """Wait for the client to go away, then call `then()`. The body has been read, so the only message left to
    receive is the disconnect (a non-streaming request has nothing else that would notice it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    then()


async def collect(state: ServerState, request: Request, prompt_ids: list[int], params: SamplingParams) -> Collected:
    out = Collected("", [], "abort")
    async for event in stream_events(state, request, prompt_ids, params):
        if event.error is not None:
            raise GenerationFailed(event.error, event.error_status)
        out.text += event.text
        out.token_ids += event.token_ids
        out.logprobs += event.logprobs
        out.prompt_logprobs = event.prompt_logprobs if event.prompt_logprobs is not None else out.prompt_logprobs
        out.finish_reason = event.finish_reason or out.finish_reason
        out.stop_string = event.stop_string or out.stop_string
        out.timing = event.timing or out.timing
    return out


async def merged_streams(streams: list) -> AsyncIterator[tuple[int, object]]:
    """(index, event) from all `streams` as they come; every stream is closed (its request aborted) when the
    consumer stops early."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream) -> None:
        try:
            async with aclosing(stream):
                async for event in stream:
                    queue.put_nowait((index, event))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, event = await queue.get()
            if event is done:
                remaining -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
