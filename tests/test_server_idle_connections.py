"""Idle connections are closed (issue: serving under hostile load, class 1): one that sends nothing after the
keep-alive timeout, one that never finishes its headers after the header deadline (--body-timeout); a normal
request on a fresh connection is served meanwhile."""

from __future__ import annotations

import socket
import time

import httpx
from server_thread import server_thread


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_silent_connections_and_trickled_headers_are_closed(tmp_path):
    with server_thread(tmp_path, body_timeout=1.0, keep_alive_timeout=0.5) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        silent = socket.create_connection((host, int(port)))
        trickle = socket.create_connection((host, int(port)))
        started = time.monotonic()
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert closed_within(silent, 5) and closed_within(trickle, 5)
        assert time.monotonic() - started < 4
