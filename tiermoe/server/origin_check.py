"""Which web pages may use the server: a page the user happens to visit must not drive the server on their machine.

A browser sends a page's requests to any address; for a "simple" request (a GET, or a POST whose body is
text/plain or a form) it asks nothing first: the request runs, only its answer is hidden from the page. So, before
anything else runs (the API key check included; /health stays open), three checks:

- Host, when bound to a loopback address: only loopback names are answered (localhost, 127.x.x.x, [::1]; any
  port). A page whose own name its DNS turns into 127.0.0.1 (DNS rebinding) is same-origin with the server in
  the browser's eyes and could read every answer; its requests still carry its name in Host: 421 Misdirected
  Request. Bound to another address the server cannot know its own names: it starts only with --api-key or
  --allowed-hosts (the names it answers to; other Hosts get 421; "*" answers any, on purpose).
- Origin: a request that carries one is refused (403) unless it is the server's own (the Host it was sent to,
  or on loopback any loopback name at the server's port) or one of --allowed-origins. Browsers send Origin on
  every cross-origin request but the GETs of images, scripts and links; curl and the SDKs send none and are
  served as before.
- Fetch Metadata: `Sec-Fetch-Site: cross-site` or `same-site` without an allowed Origin is refused (403): the
  GETs that carry no Origin (an <img src>, a link) carry this in every current browser.

An allowed origin gets CORS for itself only: Access-Control-Allow-Origin naming it (never `*`), Vary: Origin, and
its preflights (OPTIONS) answered here.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response

from tiermoe.config import ServerConfig, is_loopback
from tiermoe.server.error_format import api_error

ALLOWED_METHODS = "GET, POST, OPTIONS"
ALLOWED_HEADERS = ("Authorization", "Content-Type")
PREFLIGHT_MAX_AGE_S = 600
CROSS_SITE = ("cross-site", "same-site")  # Sec-Fetch-Site of a request made by another site's page
HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")  # an HTTP token: nothing that could split a header


def _host_and_port(authority: str) -> tuple[str, int | None] | None:
    """('name', port) of a Host header value or an origin's authority; None when it is not one."""
    try:
        parts = urlsplit("//" + authority)
        return (parts.hostname or "", parts.port) if parts.hostname else None
    except ValueError:  # a port that is not a number
        return None


class OriginCheck:
    """ASGI middleware: the Host, Origin and Sec-Fetch-Site checks, and CORS for the allowed origins."""

    def __init__(self, app, config: ServerConfig, open_paths: tuple[str, ...] = ()):
        self.app = app
        self.loopback = is_loopback(config.host)
        # off loopback: the Host names it answers to (--allowed-hosts; none given, or "*": any, the key protects)
        self.hosts = None if self.loopback or "*" in config.allowed_hosts else frozenset(config.allowed_hosts) or None
        self.port = config.port
        self.allowed = frozenset(config.allowed_origins)
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        path, headers = scope["path"], Headers(scope=scope)
        host, origin = headers.get("host"), headers.get("origin")
        if self.loopback and host is not None and not self._loopback_host(host):
            return await api_error(path, 421, f"Host '{host}' is not this server's: bound to a loopback address, it "
                                              "answers to localhost, 127.0.0.1 and [::1] only (a page that gives "
                                              "its own name this address, DNS rebinding, is refused)",
                                   "permission_error")(scope, receive, send)
        if self.hosts is not None and not self._allowed_host(host):
            return await api_error(path, 421, f"Host '{host}' is not one this server answers to (--allowed-hosts: "
                                              f"{', '.join(sorted(self.hosts))})", "permission_error")(
                scope, receive, send)
        allowed = origin is not None and self._allowed(origin, host)
        if origin is not None and not allowed:
            return await api_error(path, 403, f"a web page of origin '{origin}' may not use this server; start it "
                                              "with --allowed-origins to allow one", "permission_error")(
                scope, receive, send)
        if not allowed and headers.get("sec-fetch-site") in CROSS_SITE:
            return await api_error(path, 403, "a request made by another site's web page (Sec-Fetch-Site: "
                                              f"{headers.get('sec-fetch-site')}) may not use this server",
                                   "permission_error")(scope, receive, send)
        if not allowed:
            return await self.app(scope, receive, send)
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            return await self._preflight(origin, headers)(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                _cors(MutableHeaders(scope=message), origin)
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _loopback_host(self, host: str) -> bool:
        parsed = _host_and_port(host)
        return parsed is not None and is_loopback(parsed[0])

    def _allowed_host(self, host: str | None) -> bool:
        parsed = None if host is None else _host_and_port(host)
        return parsed is not None and parsed[0].lower() in self.hosts

    def _allowed(self, origin: str, host: str | None) -> bool:
        """The server's own origin (same-origin: sent to the Host it names; on loopback also any loopback name at
        the server's port), or one of --allowed-origins."""
        origin = origin.lower()
        if origin in self.allowed:
            return True
        scheme, _, authority = origin.partition("://")
        if scheme not in ("http", "https") or not authority:
            return False  # "null" (sandboxed frames, local files) and anything else
        if host is not None and authority == host.lower():
            return True
        parsed = _host_and_port(authority)
        return self.loopback and parsed is not None and is_loopback(parsed[0]) and parsed[1] == self.port

    def _preflight(self, origin: str, headers: Headers) -> Response:
        # The headers the page asks for are allowed too (an allowed page is trusted; the openai JS client sends
        # its own x-stainless-* headers), as long as each is a plain header name.
        asked = [h.strip() for h in headers.get("access-control-request-headers", "").split(",") if h.strip()]
        names = list(ALLOWED_HEADERS) + [h for h in asked if HEADER_NAME.match(h) and h.lower() not in
                                         {a.lower() for a in ALLOWED_HEADERS}]
        response = Response(status_code=204, headers={"Access-Control-Allow-Methods": ALLOWED_METHODS,
                                                      "Access-Control-Allow-Headers": ", ".join(names),
                                                      "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})
        _cors(response.headers, origin)
        return response


def _cors(headers: MutableHeaders, origin: str) -> None:
    headers["Access-Control-Allow-Origin"] = origin
    headers["Access-Control-Expose-Headers"] = "Retry-After"
    headers.add_vary_header("Origin")
