"""Bodies that are valid JSON text but hostile (a lone surrogate, nesting 100000 deep, a 5000-digit integer, a
seed beyond 64 bits) get a 400 in the API's own error format on every POST endpoint, never a 500 or a
traceback in the log."""

from __future__ import annotations

import logging

import httpx
import pytest
from server_thread import GOOD_BODIES, error_of, server_thread

ENDPOINTS = GOOD_BODIES
HUGE = "9" * 5000


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("bad-bodies")) as (url, _):
        yield url


def _text_field(path: str) -> tuple[str, str]:
    """Where the user's text sits in a good body: (JSON before it, JSON after it)."""
    if "chat" in path:
        return '{"messages": [{"role": "user", "content": "', '"}], "stream": false}'
    if path == "/v1/messages":
        return '{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "', '"}], "stream": false}'
    if path == "/generate":
        return '{"text": "', '", "stream": false}'
    return '{"prompt": "', '", "stream": false}'


def _bodies(path: str) -> dict[str, bytes]:
    before, after = _text_field(path)
    bodies = {"lone surrogate": (before + "a\\ud800b" + after).encode(),
              "lone low surrogate": (before + "\\udc00" + after).encode(),
              "nested 100000 deep": (before + "a" + after[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000
                                     + "}").encode(),
              "5000-digit integer in an unknown field": (before + "a" + after[:-1] + f', "x": {HUGE}}}').encode()}
    numeric = (["max_tokens", "temperature", "top_p", "top_k", "seed", "n"] if path.startswith("/v1/")
               else ["sampling_params.max_new_tokens", "sampling_params.temperature", "sampling_params.top_p",
                     "sampling_params.top_k", "sampling_params.sampling_seed", "sampling_params.n"]
               if path == "/generate"
               else ["options.num_predict", "options.temperature", "options.top_p", "options.top_k", "options.seed"])
    for field in numeric:
        for name, value in (("5000 digits", HUGE), ("65 bits", str(2**64)), ("-65 bits", str(-(2**64)))):
            if "." in field:
                outer, inner = field.split(".")
                text = (before + "a" + after[:-1] + f', "{outer}": {{"{inner}": {value}}}}}')
            else:
                text = before + "a" + after[:-1] + f', "{field}": {value}}}'
            bodies[f"{field} {name}"] = text.encode()
    return bodies


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_hostile_bodies_are_a_400_in_the_apis_own_format(url, path, caplog):
    caplog.set_level(logging.INFO)
    wrong = []
    for name, body in _bodies(path).items():
        r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        if r.status_code != 400:
            wrong.append(f"{name}: {r.status_code}")
            continue
        kind, message = error_of(path, r)
        assert kind in (None, "invalid_request_error") and message, name
    assert not wrong
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]
    good = httpx.post(url + path, json=ENDPOINTS[path], timeout=60)  # and it still serves
    assert good.status_code == 200, good.text


def test_a_valid_surrogate_pair_is_text_not_an_error(url):
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "a\\ud83d\\ude00", "max_tokens": 1}',
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
