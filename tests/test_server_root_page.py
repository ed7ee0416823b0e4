"""GET / says what the server is and lists its endpoints, each of which answers (no 404 or 405); HEAD / answers too,
as Ollama's command line checks a server with it."""

from __future__ import annotations

import httpx
from server_thread import server_thread

import tiermoe
from tiermoe.server.root_route import ENDPOINTS


def test_the_root_says_what_the_server_is_and_where_its_apis_are(tmp_path):
    with server_thread(tmp_path) as (url, state):
        r = httpx.get(url + "/", timeout=60)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        page = r.json()
        assert page["server"] == "tiermoe" and page["model"] == "tiny" and page["version"] == tiermoe.__version__
        assert "running" in page["message"] and page["endpoints"] == ENDPOINTS
        head = httpx.head(url + "/", timeout=60)
        assert head.status_code == 200 and head.content == b""
        assert httpx.get(url + "/nowhere", timeout=60).status_code == 404  # only / itself answers
        for entries in ENDPOINTS.values():
            for entry in entries:
                method, path = entry.split(" ", 1)
                # a body missing its fields: a 400 for most POSTs (one token for /api/generate), but never "no such
                # route" or "not with this method"
                body = {"options": {"num_predict": 1}} if method == "POST" else None
                answer = httpx.request(method, url + path, json=body, timeout=60)
                assert answer.status_code not in (404, 405), (entry, answer.status_code, answer.text)
