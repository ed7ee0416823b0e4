"""A client that goes away stops its request within a step or two, on every endpoint, streaming or not: the
engine frees the slot and the request counts as aborted (before, a non-streaming request generated on to
max_tokens, since the disconnect was only looked for when no token had come for 0.5 s)."""

from __future__ import annotations

import time

import httpx
import pytest
from server_thread import server_thread

STEP = 0.02  # seconds an engine step takes at least: 200 tokens last 4 s or more
LONG = 200
ENDPOINTS = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
                                      "ignore_eos": True, "temperature": 0},
             "/v1/completions": {"prompt": "hi", "max_tokens": LONG, "ignore_eos": True, "temperature": 0},
             "/api/chat": {"messages": [{"role": "user", "content": "hi"}],
                           "options": {"num_predict": LONG, "temperature": 0}},
             "/api/generate": {"prompt": "hi", "options": {"num_predict": LONG, "temperature": 0}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("disconnect"), step_sleep=STEP) as (url, state):
        yield url, state


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_a_client_that_leaves_frees_its_slot_within_a_step_or_two(served, path, stream):
    url, state = served
    aborted = state.metrics.requests_aborted
    steps = []
    state.llm.engine.after_step_hooks.append(lambda: steps.append(time.monotonic()))
    body = {**ENDPOINTS[path], "stream": stream}
    if stream:  # the client reads a few pieces, then closes the connection
        with httpx.stream("POST", url + path, json=body, timeout=10) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 3:
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.3 s and closes the connection
            httpx.post(url + path, json=body, timeout=0.3)
    left = time.monotonic()
    try:
        while state.service.running and time.monotonic() - left < 10:
            time.sleep(0.01)
    finally:
        state.llm.engine.after_step_hooks.pop()
    assert state.service.running == 0, "the request still generates after its client left"
    after = sum(t > left for t in steps)  # counted in engine steps, not seconds: a loaded machine steps slower
    assert after <= 5, f"{after} engine steps ran after the client left"
    assert state.metrics.requests_aborted == aborted + 1
