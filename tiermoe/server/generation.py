"""Running one request through the engine service: as a stream of events, or collected into one result."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from tiermoe.engine.sampling import SamplingParams
from tiermoe.server.engine_service import Event
from tiermoe.server.state import ServerState


class GenerationFailed(RuntimeError):
    """The engine reported an error for this request: a 400 when its own values caused it, else a 500."""

    def __init__(self, message: str, client_error: bool = False):
        super().__init__(message)
        self.status = 400 if client_error else 500


@dataclass
class Collected:
    text: str
    token_ids: list[int]
    finish_reason: str


async def stream_events(state: ServerState, request: Request, prompt_ids: list[int],
                        params: SamplingParams) -> AsyncIterator[Event]:
    """Events until the last one (an error is an event too: `error` set, finish_reason "error"; a stream says so
    to its client). If the client goes away (the consumer is cancelled, or the connection closes while we wait),
    the request is aborted at once and its slot freed."""
    handle = state.service.submit(prompt_ids, params)
    try:
        while True:
            try:
                event = await asyncio.wait_for(handle.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            yield event
            if event.finish_reason is not None:
                return
    finally:
        state.service.abort(handle)


async def collect(state: ServerState, request: Request, prompt_ids: list[int], params: SamplingParams) -> Collected:
    text, ids, reason = [], [], "abort"
    async for event in stream_events(state, request, prompt_ids, params):
        if event.error is not None:
            raise GenerationFailed(event.error, event.client_error)
        text.append(event.text)
        ids.extend(event.token_ids)
        reason = event.finish_reason or reason
    return Collected("".join(text), ids, reason)
