"""A chat template that raises on purpose (Qwen3's "No user query found" for a system-only conversation, a
template's role alternation) refuses the client's conversation: a 400 with the template's message on every chat
route, streamed or not, and no traceback in the log (issue: replies and request options, class 2)."""

from __future__ import annotations

import logging

import httpx
import pytest
from server_thread import server_thread

REFUSING = "{{ raise_exception('No user query found in messages.') }}"
MESSAGES = [{"role": "system", "content": "be brief"}]
ROUTES = {
    "openai": ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 2}),
    "openai-stream": ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 2, "stream": True}),
    "ollama": ("/api/chat", {"model": "m", "messages": MESSAGES, "stream": False}),
    "ollama-stream": ("/api/chat", {"model": "m", "messages": MESSAGES}),
    "anthropic": ("/v1/messages", {"model": "m", "system": "be brief", "max_tokens": 2,
                                   "messages": [{"role": "user", "content": "hi"}]}),
}


@pytest.fixture(scope="module")
def refusing_server(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("template")) as (url, state):
        state.llm.tokenizer.chat_template = REFUSING
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_template_that_raises_is_a_400_with_its_message(refusing_server, route, caplog):
    path, body = ROUTES[route]
    with caplog.at_level(logging.INFO):
        r = refusing_server.post(path, json=body)
    # on the parent: a plain-text 500 "Internal Server Error" and the template's traceback in the log
    assert r.status_code == 400, (r.status_code, r.text)
    assert "No user query found in messages." in r.text and "chat template refused" in r.text
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
