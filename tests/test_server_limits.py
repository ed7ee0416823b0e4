"""What one request may cost the server is bounded: a body longer than --max-request-bytes is a 413 in the API's
own format (by its Content-Length, or as soon as a chunked body runs past it), a prompt whose characters cannot
fit the context is refused before it is tokenised, and tokenising runs off the event loop (/health answers)."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_thread import GOOD_BODIES, error_of, server_thread

LIMIT = 16 << 10
ENDPOINTS = GOOD_BODIES
TOKENIZING = {"/v1/chat/completions": "chat_prompt_ids", "/v1/completions": "encode", "/generate": "encode",
              "/api/chat": "chat_prompt_ids", "/api/generate": "chat_prompt_ids", "/v1/messages": "chat_prompt_ids"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("limits"), max_request_bytes=LIMIT) as (url, state):
        yield url, state


def _with_text(path: str, text: str) -> dict:
    body = dict(ENDPOINTS[path])
    if "messages" in body:
        return {**body, "messages": [{"role": "user", "content": text}]}
    return {**body, "text" if "text" in body else "prompt": text}


def _assert_format(path: str, r: httpx.Response, status: int, fragment: str) -> None:
    assert r.status_code == status, r.text
    _, message = error_of(path, r)
    assert fragment in message, message


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_a_body_longer_than_the_limit_is_a_413_however_it_is_sent(served, path):
    url, _ = served
    body = httpx.Request("POST", "/", json={**ENDPOINTS[path], "padding": "x" * LIMIT}).content
    r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    _assert_format(path, r, 413, f"longer than this server takes ({LIMIT} bytes")

    def chunked():  # no Content-Length: the server counts as it reads
        for i in range(0, len(body), 1024):
            yield body[i:i + 1024]

    r = httpx.post(url + path, content=chunked(), headers={"Content-Type": "application/json"}, timeout=60)
    _assert_format(path, r, 413, f"longer than this server takes ({LIMIT} bytes")
    fits = httpx.post(url + path, json=_with_text(path, "a" * 200), timeout=60)
    assert fits.status_code == 200, fits.text


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_a_prompt_too_long_for_the_context_in_any_tokenisation_is_refused_untokenised(served, path, monkeypatch):
    url, state = served
    calls = []
    real = getattr(state.llm, TOKENIZING[path])
    monkeypatch.setattr(state.llm, TOKENIZING[path], lambda *a, **k: calls.append(1) or real(*a, **k))
    too_long = LIMIT - 1024  # the tiny model: 256 tokens of at most 5 characters (its longest entry is "<pad>")
    assert too_long > 256 * 5 * 4
    r = httpx.post(url + path, json=_with_text(path, "a" * too_long), timeout=60)
    _assert_format(path, r, 400, f"the prompt has {too_long} characters")
    assert calls == []


def test_health_answers_while_a_prompt_is_tokenised(served, monkeypatch):
    """Causal, not timed: the tokeniser is held until /health has answered, so a tokeniser on the event loop
    would leave /health unanswered (its timeout fails the test) however loaded the machine is."""
    url, state = served
    entered, release = threading.Event(), threading.Event()

    def held(real):
        def tokenise(*a, **k):
            entered.set()
            release.wait(60)
            return real(*a, **k)
        return tokenise

    for name in set(TOKENIZING.values()):
        monkeypatch.setattr(state.llm, name, held(getattr(state.llm, name)))
    for path, body in ENDPOINTS.items():
        entered.clear()
        release.clear()
        answer = {}

        def ask_it(path=path, body=body, answer=answer):
            answer["r"] = httpx.post(url + path, json=body, timeout=60)

        ask = threading.Thread(target=ask_it)
        ask.start()
        try:
            assert entered.wait(30), f"{path}: the request never reached the tokeniser"
            assert httpx.get(url + "/health", timeout=10).status_code == 200, path
            assert not release.is_set() and ask.is_alive(), path  # answered while the prompt was held
        finally:
            release.set()
            ask.join()
        assert answer["r"].status_code == 200, answer["r"].text
