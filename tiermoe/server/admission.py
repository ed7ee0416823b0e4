"""A bounded wait: generation requests beyond --max-running-requests + --max-queued-requests are refused on
arrival, before their body is read, so a flood costs the server almost nothing and the requests it took keep
their pace.

A request holds its slot from arrival (reading and tokenising count: that is work the server took on) until its
response has been sent or abandoned in any way: finished, failed, refused by validation, timed out, or its
client gone. A plain ASGI middleware sees exactly that span: the app call returns only once a streamed body has
ended, and a disconnect ends it too.

The refusal is 503 Service Unavailable with Retry-After, as SGLang answers when its queue is full ("The request
queue is full."): the server as a whole is at capacity for everyone, which is what 503 says; 429 would blame one
client for sending too many (a rate limit), and a client's backoff for 429 often waits far longer. The openai
client (and most HTTP clients) retry a 503 after Retry-After by themselves.
"""

from __future__ import annotations

from tiermoe.server.error_format import api_error
from tiermoe.server.metrics import ServerMetrics

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate", "/api/chat", "/api/generate",
                              "/v1/messages"})
# A slot frees whenever any running request ends, and a refusal costs the server nothing: clients may come back
# soon. Waiting longer is their choice (the openai client backs off further on repeated refusals).
RETRY_AFTER_S = 1


class Admission:
    """Generation requests in flight, counted on the event loop (one thread: no lock)."""

    def __init__(self, limit: int, running: int, queued: int):
        self.limit = limit
        self.in_flight = 0
        self.what = f"--max-running-requests {running} + --max-queued-requests {queued}"

    def enter(self) -> bool:
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1


class AdmissionMiddleware:
    """Admit or refuse each POST to a generation endpoint on arrival; hold its slot until its response ends."""

    def __init__(self, app, admission: Admission, metrics: ServerMetrics):
        self.app = app
        self.admission = admission
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "POST" or path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if not self.admission.enter():
            self.metrics.add(requests_refused=1)
            response = api_error(path, 503, f"the server is busy: {self.admission.limit} requests are running or "
                                            f"queued ({self.admission.what}); retry after {RETRY_AFTER_S} s",
                                 "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
            return await response(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave()
