"""Connections that send nothing, or never finish a request's headers, are closed.

uvicorn's keep-alive timeout (`--timeout-keep-alive`, 5 s by default) starts only after a response, and nothing
bounds the time a request's headers take: a client that opens a connection and never sends a request (2,000 of
them, in the adversarial soak), or sends its headers a byte now and then, would hold a socket and a file
descriptor for ever. Here:
- the keep-alive timeout also starts when the connection is made (a request's first bytes cancel it, as they do
  between requests);
- a request's headers must be complete within `header_timeout` seconds (the server's --body-timeout) of the
  connection's start or of its previous response, else the connection is closed. The body then has its own
  deadline (tiermoe.server.admission).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def idle_closing_h11(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the two deadlines above (pass it as uvicorn.Config(http=...))."""

    class IdleClosingH11(H11Protocol):
        _headers_due: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)
            self._expect_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._expect_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._headers_due is not None:
                self._headers_due.cancel()
            super().connection_lost(exc)

        def _expect_headers(self) -> None:
            if self._headers_due is not None:
                self._headers_due.cancel()
            self._headers_due = self.loop.call_later(header_timeout, self._headers_late)

        def _headers_late(self) -> None:
            if self.cycle is None or self.cycle.response_complete:  # no request in progress: its headers never came
                self.timeout_keep_alive_handler()

    return IdleClosingH11
