"""Ollama's final record carries its counts and durations, measured per request (nanoseconds, as Ollama): streamed
or not, on /api/generate and /api/chat. Whatever model a request names, the reply names the served one."""

from __future__ import annotations

import json

import httpx
import pytest
from server_thread import server_thread

from tiermoe.server.ollama_durations import ollama_durations
from tiermoe.server.request_timing import RequestTiming

STEP_SLEEP = 0.02  # seconds after every engine step: durations have a floor the test can count on
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("ollama-timing"), step_sleep=STEP_SLEEP) as (url, state):
        state.llm.engine.eos_token_ids = frozenset()  # every reply runs to num_predict
        yield url, state


def final_record(url: str, path: str, stream: bool, model: str) -> tuple[dict, list[dict]]:
    body = {"model": model, "stream": stream, "options": {"num_predict": 5, "temperature": 0}}
    body |= {"prompt": "hello"} if path == "/api/generate" else {"messages": [{"role": "user", "content": "hello"}]}
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    lines = [json.loads(line) for line in r.text.splitlines()] if stream else [r.json()]
    return lines[-1], lines


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_the_final_record_has_ollamas_counts_and_durations(server, path, stream):
    url, state = server
    final, lines = final_record(url, path, stream, "llama3")
    assert final["done"] and final["done_reason"] == "length"
    assert all(line["model"] == "tiny" for line in lines)  # the served model, not the name asked for
    prompt_ids = state.llm.chat_prompt_ids([{"role": "user", "content": "hello"}])  # the chat template, both routes
    assert final["prompt_eval_count"] == len(prompt_ids) and final["eval_count"] == 5
    assert all(isinstance(final[name], int) for name in DURATIONS)
    # five tokens: the four after the first each took a step (and its sleep); the prompt took at least one step
    assert final["eval_duration"] >= 4 * STEP_SLEEP * 1e9
    assert final["prompt_eval_duration"] >= STEP_SLEEP * 1e9
    assert final["load_duration"] >= 0
    parts = final["load_duration"] + final["prompt_eval_duration"] + final["eval_duration"]
    assert final["total_duration"] >= parts


def test_a_stage_never_reached_ends_where_the_next_began_or_at_the_final_record():
    stopped_in_prefill = ollama_durations(10.0, RequestTiming(11.0, None, None), 12.5)
    assert stopped_in_prefill == {"total_duration": 2_500_000_000, "load_duration": 1_000_000_000,
                                  "prompt_eval_duration": 1_500_000_000, "eval_duration": 0}
    never_admitted = ollama_durations(10.0, None, 10.5)
    assert never_admitted["load_duration"] == never_admitted["total_duration"] == 500_000_000
    one_token = ollama_durations(10.0, RequestTiming(10.25, 10.5, 10.5), 11.0)
    assert (one_token["prompt_eval_duration"], one_token["eval_duration"]) == (250_000_000, 0)
