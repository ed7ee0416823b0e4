"""Fields the server does not implement are accepted at their neutral value and refused otherwise with a 400 that
names the field and says it is not supported, in the API's own error format: never silently ignored."""

from __future__ import annotations

import httpx
import pytest
from server_thread import GOOD_BODIES, server_thread

CHAT, COMPLETIONS, OLLAMA_CHAT, OLLAMA_GENERATE = "/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"

# (endpoint, field, a value the server cannot honour, the neutral value clients send when they do not use it)
FIELDS = [
    (CHAT, "tool_choice", {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "none"),
    (CHAT, "functions", [{"name": "f"}], None),
    (CHAT, "use_beam_search", True, False),
    (CHAT, "guided_json", {"type": "object"}, None),
    (CHAT, "add_generation_prompt", False, True),
    (CHAT, "modalities", ["text", "audio"], ["text"]),
    (CHAT, "reasoning_effort", "high", None),
    (CHAT, "store", True, False),
    (COMPLETIONS, "best_of", 3, 1),
    (COMPLETIONS, "suffix", "the end", ""),
    (COMPLETIONS, "length_penalty", 1.5, 1.0),
    (COMPLETIONS, "include_stop_str_in_output", True, None),
    (OLLAMA_CHAT, "think", True, False),
    (OLLAMA_GENERATE, "suffix", "end", ""),
    (OLLAMA_GENERATE, "images", ["aGk="], []),
    (OLLAMA_GENERATE, "context", [5, 6], []),
    (OLLAMA_GENERATE, "options.typical_p", 0.5, 1.0),
    (OLLAMA_GENERATE, "options.mirostat", 2, 0),
]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("unsupported")) as (url, _):
        yield url


def with_field(path: str, field: str, value) -> dict:
    body = dict(GOOD_BODIES[path])
    if field.startswith("options."):
        body["options"] = {**body.get("options", {}), field.split(".")[1]: value}
    else:
        body[field] = value
    return body


def error_message(path: str, response: httpx.Response) -> str:
    body = response.json()
    return body["error"]["message"] if path.startswith("/v1/") else body["error"]


@pytest.mark.parametrize("path, field, value, neutral", FIELDS, ids=[f"{p} {f}" for p, f, _, _ in FIELDS])
def test_a_field_not_implemented_is_refused_unless_neutral(url, path, field, value, neutral):
    refused = httpx.post(url + path, json=with_field(path, field, value), timeout=60)
    assert refused.status_code == 400
    message = error_message(path, refused)
    assert field.split(".")[-1] in message and "is not supported by this server" in message
    accepted = httpx.post(url + path, json=with_field(path, field, neutral), timeout=60)
    assert accepted.status_code == 200, accepted.text


@pytest.mark.parametrize("path", [CHAT, OLLAMA_CHAT])
def test_an_image_in_a_message_is_refused_not_dropped(url, path):
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    body = {**GOOD_BODIES[path], "messages": [{"role": "user", "content": content}]}
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400 and "type" in error_message(path, r) and "'text'" in error_message(path, r)


@pytest.mark.parametrize("path, extra, says", [
    (CHAT, {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (COMPLETIONS, {"logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens 0 needs echo: true"),
])
def test_logprob_settings_out_of_range_are_a_400(url, path, extra, says):
    r = httpx.post(url + path, json={**GOOD_BODIES[path], **extra}, timeout=60)
    assert r.status_code == 400 and says in error_message(path, r)


def test_labels_that_change_nothing_are_accepted(url):
    body = {**GOOD_BODIES[CHAT], "user": "u-1", "metadata": {"run": "7"}, "parallel_tool_calls": False,
            "service_tier": "auto"}
    assert httpx.post(url + CHAT, json=body, timeout=60).status_code == 200
    ollama = {**GOOD_BODIES[OLLAMA_CHAT], "keep_alive": "5m", "options": {"num_predict": 2, "num_ctx": 4096}}
    assert httpx.post(url + OLLAMA_CHAT, json=ollama, timeout=60).status_code == 200
