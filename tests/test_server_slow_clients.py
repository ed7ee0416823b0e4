"""Slow or silent clients hold no admission slot (issue: serving under hostile load, class 1): a body is read whole,
within --body-timeout, before its request takes a slot; a body that does not arrive in time is a 408; a client that
goes away mid-body is one log line, never a traceback."""

from __future__ import annotations

import logging
import socket
import time

import httpx
from server_thread import server_thread

SLOTS = 2


def slow_body(url: str, path: str = "/v1/completions") -> socket.socket:
    """A connection that promises a 4000-byte body and sends 10 bytes of it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 4000\r\n\r\n{{\"prompt\":".encode())
    return sock


def test_more_slow_bodies_than_slots_leave_a_normal_request_served_and_each_gets_its_408(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with server_thread(tmp_path, max_running_requests=SLOTS, max_queued_requests=0, body_timeout=2.0) as (url, _):
        slow = [slow_body(url) for _ in range(2 * SLOTS + 1)]
        gone = slow_body(url, "/v1/chat/completions")
        time.sleep(0.3)  # every slow body has arrived at the server and is being read
        gone.close()  # a client that goes away mid-body
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text  # the slow ones hold no slot
        for sock in slow:
            sock.settimeout(10)
            answer = b"".join(iter(lambda sock=sock: sock.recv(4096), b"")).decode()  # to its close
            assert answer.startswith("HTTP/1.1 408"), answer
            assert "--body-timeout" in answer
            sock.close()
    assert any("went away before its request body arrived" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
