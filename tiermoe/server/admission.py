"""A bounded wait: generation requests beyond --max-running-requests + --max-queued-requests are refused once their
body has arrived, so a flood costs the server almost nothing and the requests it took keep their pace, and a client
that sends its body slowly (or never) holds no slot meanwhile.

Per generation POST, in order:
1. the body is read whole, at most --max-request-bytes of it (413 beyond, found while reading) and within
   --body-timeout seconds of the request's arrival (408 after: a client trickling a byte every few seconds cannot
   hold a connection open for ever); a client gone meanwhile ends it with one log line;
2. then it takes a slot, or is refused with 503 and Retry-After; a batch of prompts (/v1/completions, /generate)
   takes one slot per prompt once its route has read how many (`take_batch`): a batch larger than the free slots
   is a 503 with Retry-After, larger than all of them a 400 (ServerConfig.check_prompt_batch), so admission
   counts sequences and the engine's queue never holds more than the slots;
3. the route reads the body from memory (the receive channel is replayed to it), and the slot is held until the
   response has been sent or abandoned in any way: finished, failed, refused by validation, timed out, or its
   client gone. A plain ASGI middleware sees exactly that span: the app call returns only once a streamed body has
   ended, and a disconnect ends it too.

The refusal is 503 Service Unavailable with Retry-After, as SGLang answers when its queue is full ("The request
queue is full."): the server as a whole is at capacity for everyone, which is what 503 says; 429 would blame one
client for sending too many (a rate limit), and a client's backoff for 429 often waits far longer. The openai
client (and most HTTP clients) retry a 503 after Retry-After by themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tiermoe.server.body import too_large_message
from tiermoe.server.error_format import api_error
from tiermoe.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate", "/api/chat", "/api/generate",
                              "/v1/messages"})
# A slot frees whenever any running request ends, and a refusal costs the server nothing: clients may come back
# soon. Waiting longer is their choice (the openai client backs off further on repeated refusals).
RETRY_AFTER_S = 1


BATCH_SLOTS = "tiermoe_batch_slots"  # the slots a batch's prompts beyond its first took, in the request's scope state


class Admission:
    """Generation sequences in flight (a request, or each prompt of a batch), counted on the event loop (one
    thread: no lock)."""

    def __init__(self, limit: int, running: int, queued: int):
        self.limit = limit
        self.in_flight = 0
        self.what = f"--max-running-requests {running} + --max-queued-requests {queued}"

    def enter(self, slots: int = 1) -> bool:
        if self.in_flight + slots > self.limit:
            return False
        self.in_flight += slots
        return True

    def leave(self, slots: int = 1) -> None:
        self.in_flight -= slots

    def busy(self, asked: int = 1) -> str:
        if asked == 1:
            return (f"the server is busy: {self.limit} requests are running or queued ({self.what}); retry after "
                    f"{RETRY_AFTER_S} s")
        return (f"the server is busy: {self.in_flight} of its {self.limit} slots are taken by running or queued "
                f"requests ({self.what}), too many for a batch of {asked} prompts; retry after {RETRY_AFTER_S} s")


class AdmissionRefused(Exception):
    """A 503 with Retry-After (tiermoe.server.app answers it)."""


def take_batch(scope: dict, admission: Admission, prompts: int) -> None:
    """A batch's prompts beyond its first take a slot each (the first took the request's); they are noted in the
    request's scope state, and the middleware gives them back when the response ends. AdmissionRefused when the
    free slots are too few."""
    extra = prompts - 1
    if extra <= 0:
        return
    if not admission.enter(extra):
        raise AdmissionRefused(admission.busy(prompts))
    state = scope.setdefault("state", {})
    state[BATCH_SLOTS] = state.get(BATCH_SLOTS, 0) + extra


class BodyRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def read_whole_body(scope, receive, limit: int, timeout_s: float) -> bytes | None:
    """The request's body, read from the ASGI channel; None when the client went away first. BodyRefused: 413 for
    a body longer than `limit` (a declared Content-Length before any byte is read), 408 when it has not all come
    `timeout_s` seconds after the request arrived."""
    declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise BodyRefused(408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout)") \
                from None
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit: int) -> BodyRefused:
    return BodyRefused(413, too_large_message(limit))


def busy_response(path: str, message: str):
    return api_error(path, 503, message, "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})


def replayed(body: bytes, receive):
    """A receive channel that hands the app `body` in one message, then what the client sends next (a
    disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_again():
        return pending.pop() if pending else await receive()

    return receive_again


class AdmissionMiddleware:
    """For each POST to a generation endpoint: read its body (bounded in bytes and time), then admit or refuse it;
    hold its slot until its response ends."""

    def __init__(self, app, admission: Admission, metrics: ServerMetrics, max_body_bytes: int, body_timeout: float):
        self.app = app
        self.admission = admission
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "POST" or path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        try:
            body = await read_whole_body(scope, receive, self.max_body_bytes, self.body_timeout)
        except BodyRefused as err:
            response = api_error(path, err.status, str(err), headers={"Connection": "close"})
            return await response(scope, receive, send)
        if body is None:  # answered all the same (nobody reads it): the middlewares outside expect an answer
            log.info("%s: the client went away before its request body arrived", path)
            return await api_error(path, 400, "the client went away before its request body arrived")(
                scope, receive, send)
        if not self.admission.enter():
            self.metrics.add(requests_refused=1)
            return await busy_response(path, self.admission.busy())(scope, receive, send)
        request_state = scope.setdefault("state", {})  # the route adds a batch's slots here (take_batch)
        try:
            await self.app(scope, replayed(body, receive), send)
        finally:
            self.admission.leave(1 + request_state.pop(BATCH_SLOTS, 0))
