"""--request-timeout stops a request that runs longer: the engine frees its slot within a step, a non-streaming
client gets a 504 in its API's error format, a stream ends with the error (OpenAI: a chunk with finish_reason
"error" and the error object, then [DONE]; Ollama: the done line with done_reason "error"), and it is counted in
/metrics as timed out, not as aborted by its client. A request that ends in time is served as before."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_thread import GOOD_BODIES, server_thread

TIMEOUT = 0.3
LONG = 200  # tokens: 4 s or more at 0.02 s a step
BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
                                   "ignore_eos": True},
          "/v1/completions": {"prompt": "hi", "max_tokens": LONG, "ignore_eos": True},
          "/api/chat": {"messages": [{"role": "user", "content": "hi"}],
                        "options": {"num_predict": LONG, "temperature": 0}},
          "/api/generate": {"prompt": "hi", "options": {"num_predict": LONG, "temperature": 0}}}
MESSAGE = f"generation failed: the request took longer than the server's --request-timeout ({TIMEOUT:g} s) and " \
          "was stopped"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("timeout"), step_sleep=0.02, request_timeout=TIMEOUT) as (url, state):
        yield url, state


def _assert_stopped(state, timed_out: int, aborted: int, started: float) -> None:
    while state.service.running and time.monotonic() - started < 3:
        time.sleep(0.01)
    assert state.service.running == 0, "the request still generates after its timeout"
    assert time.monotonic() - started < TIMEOUT + 1.0
    assert state.metrics.requests_timed_out == timed_out + 1
    assert state.metrics.requests_aborted == aborted


@pytest.mark.parametrize("path", list(BODIES))
def test_a_request_past_the_timeout_is_a_504_and_its_slot_is_freed(served, path):
    url, state = served
    timed_out, aborted, started = state.metrics.requests_timed_out, state.metrics.requests_aborted, time.monotonic()
    r = httpx.post(url + path, json={**BODIES[path], "stream": False}, timeout=30)
    assert r.status_code == 504, r.text
    if path.startswith("/v1/"):
        assert r.json() == {"error": {"message": MESSAGE, "type": "server_error", "param": None, "code": 504}}
    else:
        assert r.json() == {"error": MESSAGE}
    _assert_stopped(state, timed_out, aborted, started)


@pytest.mark.parametrize("path", list(BODIES))
def test_a_stream_past_the_timeout_ends_with_the_error(served, path):
    url, state = served
    timed_out, aborted, started = state.metrics.requests_timed_out, state.metrics.requests_aborted, time.monotonic()
    with httpx.stream("POST", url + path, json={**BODIES[path], "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    if path.startswith("/v1/"):
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "error"
        assert last["error"] == {"message": MESSAGE, "type": "server_error", "param": None, "code": 504}
        assert len(lines) > 3  # some tokens came before the timeout
    else:
        last = json.loads(lines[-1])
        assert last["done"] is True and last["done_reason"] == "error" and last["error"] == MESSAGE
    _assert_stopped(state, timed_out, aborted, started)


def test_a_request_within_the_timeout_is_served_and_metrics_count_timeouts(served):
    url, state = served
    for path, body in GOOD_BODIES.items():
        assert httpx.post(url + path, json=body, timeout=30).status_code == 200
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert f"tiermoe_requests_timed_out_total {state.metrics.requests_timed_out}" in metrics
