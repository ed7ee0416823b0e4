"""The wait is bounded: generation requests beyond --max-running-requests + --max-queued-requests are refused on
arrival (503 with Retry-After, in each API's error format, before the body is even read), the requests taken
finish exactly as alone, and a slot frees however its request ends (finished, refused by validation, client
gone). Refusals are counted in /metrics. (Before, every request was queued: the wait grew without bound.)"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_thread import GOOD_BODIES, server_thread

RUNNING, QUEUED = 2, 1
SLOW = {"prompt": "a story", "max_tokens": 40, "ignore_eos": True, "temperature": 0}  # 0.8 s or more


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("admission"), step_sleep=0.02, max_running_requests=RUNNING,
                       max_queued_requests=QUEUED) as (url, state):
        yield url, state


def _wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _fill_then_refuse(url: str, state) -> list[httpx.Response]:
    """Take every slot with a slow request, check that one more on each endpoint is refused at once, and return
    the taken ones' answers."""
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(httpx.post(url + "/v1/completions", json=SLOW,
                                                                         timeout=60)))
               for _ in range(RUNNING + QUEUED)]
    for t in threads:
        t.start()
    assert _wait_for(lambda: state.service.running + state.service.queue_length == RUNNING + QUEUED)
    for path in GOOD_BODIES:  # a body that is not even JSON: refused before it is read, so a 503, not a 400
        r = httpx.post(url + path, content=b"{not json", headers={"Content-Type": "application/json"}, timeout=10)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        message = "the server is busy: 3 requests are running or queued (--max-running-requests 2 + " \
                  "--max-queued-requests 1); retry after 1 s"
        if path.startswith("/api/"):  # Ollama: a string; Anthropic: its error shape; OpenAI, SGLang: an object
            assert r.json() == {"error": message}
        elif path.startswith("/v1/messages"):
            assert r.json() == {"type": "error", "error": {"type": "overloaded_error", "message": message}}
        else:
            assert r.json() == {"error": {"message": message, "type": "server_error", "param": None, "code": 503}}
    for t in threads:
        t.join()
    return answers


def test_requests_beyond_the_bound_get_503_with_retry_after_and_the_taken_ones_finish_as_alone(served):
    url, state = served
    alone = httpx.post(url + "/v1/completions", json=SLOW, timeout=60).json()["choices"][0]["text"]
    refused = state.metrics.requests_refused
    answers = _fill_then_refuse(url, state)
    assert state.metrics.requests_refused == refused + len(GOOD_BODIES)
    assert len(answers) == RUNNING + QUEUED
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == alone and r.json()["usage"]["completion_tokens"] == 40
    assert _wait_for(lambda: state.admission.in_flight == 0, 10.0)  # the slot frees just after the last byte
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert f"tiermoe_requests_refused_total {state.metrics.requests_refused}" in metrics
    assert "tiermoe_requests_in_flight 0" in metrics
    assert httpx.post(url + "/v1/completions", json=GOOD_BODIES["/v1/completions"], timeout=60).status_code == 200


def test_a_slot_frees_however_its_request_ends(served):
    url, state = served
    for _ in range(2 * (RUNNING + QUEUED)):  # refused by validation
        r = httpx.post(url + "/api/generate", json={"prompt": "hi", "stream": False, "options": {"top_p": 0}},
                       timeout=10)
        assert r.status_code == 400, r.text
    with pytest.raises(httpx.ReadTimeout):  # a client that leaves
        httpx.post(url + "/v1/completions", json=SLOW, timeout=0.2)
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=10,  # a stream read to its end
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and list(r.iter_lines())[-2] == "data: [DONE]"
    assert _wait_for(lambda: state.service.running == 0 and state.admission.in_flight == 0, 10.0)  # loaded CI
    # every slot is free again: exactly RUNNING + QUEUED requests are taken, and they finish
    assert all(r.status_code == 200 for r in _fill_then_refuse(url, state))
    assert _wait_for(lambda: state.admission.in_flight == 0, 10.0)  # the slot frees just after the last byte
