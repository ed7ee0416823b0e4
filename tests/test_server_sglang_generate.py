"""SGLang's native POST /generate: one prompt (text or input_ids), a batch, streaming; the same greedy tokens as
/v1/completions; bad values a 400 for the whole request, in the error shape SGLang's clients read."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import httpx
import pytest
from server_thread import server_thread

from tiermoe.server import sglang_routes

GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("sglang")) as (url, state):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client, state


def completion_ids(client, prompt) -> tuple[str, list[int]]:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                             "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


def test_single_text_matches_completions(server):
    client, state = server
    r = client.post("/generate", json={"text": "hello", "sampling_params": GREEDY, "rid": "r-1"})
    assert r.status_code == 200, r.text
    out = r.json()
    text, _ = completion_ids(client, "hello")
    assert out["text"] == text
    assert len(out["output_ids"]) == 5 and state.llm.engine.detokenize(out["output_ids"]) == text
    meta = out["meta_info"]
    assert meta["id"] == "r-1"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(state.llm.encode("hello")) and meta["completion_tokens"] == 5


def test_input_ids_and_batch(server):
    client, state = server
    ids = state.llm.encode("abc")
    single = client.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    assert single["text"] == completion_ids(client, ids)[0]
    batch = client.post("/generate", json={"text": ["abc", "xyz"], "sampling_params": [GREEDY, {**GREEDY,
                                                                                              "max_new_tokens": 3}]})
    assert batch.status_code == 200, batch.text
    first, second = batch.json()
    assert first["output_ids"] == single["output_ids"]
    assert second["meta_info"]["completion_tokens"] == 3 and first["meta_info"]["id"] != second["meta_info"]["id"]
    by_ids = client.post("/generate", json={"input_ids": [ids, ids], "sampling_params": GREEDY}).json()
    assert [o["output_ids"] for o in by_ids] == [single["output_ids"]] * 2


def test_stop_token_reports_what_matched(server):
    client, _ = server
    first = client.post("/generate", json={"text": "hello", "sampling_params": GREEDY}).json()["output_ids"]
    r = client.post("/generate", json={"text": "hello", "sampling_params": {**GREEDY,
                                                                            "stop_token_ids": [first[1]]}})
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[1]}


def events(client, body) -> list:
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_stream_sends_the_text_so_far(server):
    client, _ = server
    whole = client.post("/generate", json={"text": "hello", "sampling_params": GREEDY}).json()
    streamed = events(client, {"text": "hello", "sampling_params": GREEDY, "stream": True})
    assert len(streamed) >= 2 and streamed[-1]["text"] == whole["text"]
    assert streamed[-1]["output_ids"] == whole["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in streamed[:-1])
    assert streamed[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(whole["text"].startswith(e["text"]) for e in streamed)

    batch = events(client, {"text": ["hello", "abc"], "sampling_params": GREEDY, "stream": True})
    last = {e["index"]: e for e in batch}
    assert sorted(last) == [0, 1] and last[0]["text"] == whole["text"]


def test_incremental_streaming_output_sends_each_events_new_text_and_ids(server):
    client, state = server
    whole = client.post("/generate", json={"text": "hello", "sampling_params": GREEDY}).json()
    config = state.config
    state.config = dataclasses.replace(config, incremental_streaming_output=True)
    try:
        streamed = events(client, {"text": "hello", "sampling_params": GREEDY, "stream": True})
    finally:
        state.config = config
    assert len(streamed) >= 2 and "".join(e["text"] for e in streamed) == whole["text"]
    assert [i for e in streamed for i in e["output_ids"]] == whole["output_ids"]
    assert streamed[-1]["meta_info"]["completion_tokens"] == 5


@pytest.mark.parametrize("length", [40, 4000])
def test_a_stream_event_encodes_only_its_new_text_and_ids(length, monkeypatch):
    """The text and ids so far are re-sent at each event (SGLang's contract), but encoded a piece at a time."""
    encoded = [0]

    def counted_dumps(value):
        encoded[0] += len(value) if isinstance(value, str | list) else 0
        return json.dumps(value)

    monkeypatch.setattr(sglang_routes, "json", SimpleNamespace(dumps=counted_dumps))
    out = sglang_routes._StreamedOutput(sglang_routes._Prompt("r", [1, 2], None), incremental=False)
    per_event, text, ids = [], "", []
    for i in range(length):
        piece = "é\"x\n" if i % 2 else "🙂 "
        encoded[0] = 0
        payload = json.loads(out.event(piece, [i], "length" if i == length - 1 else None, None, {"index": 3}))
        per_event.append(encoded[0])
        text, ids = text + piece, ids + [i]
        assert (payload["text"], payload["output_ids"], payload["index"]) == (text, ids, 3)
    assert payload["meta_info"]["finish_reason"] == {"type": "length", "length": length}
    assert max(per_event) <= 16, max(per_event)  # the new piece, its id, and the key "index"


@pytest.mark.parametrize("body, where", [
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "hi", "sampling_params": {"regex": "a+"}}, "regex"),
    ({"text": "hi", "sampling_params": {"n": 0}}, "n"),
    ({"text": ["hi", "yo"], "sampling_params": [{"n": 1}, {"n": 2}]}, "n must be the same for every prompt"),
    ({"text": "hi", "sampling_params": {"min_p": 2}}, "min_p"),
    ({"text": "hi", "lora_path": "sql"}, "lora_path: there is no LoRA adapter 'sql'"),
    ({"text": "hi", "input_ids": [1]}, "either text or input_ids"),
    ({"text": ["hi", "yo"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "hi", "return_logprob": True}, "return_logprob"),
])
def test_bad_values_are_a_400(server, body, where):
    client, _ = server
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert where in r.json()["error"]["message"]  # SGLang's clients read error.message


def test_one_bad_prompt_refuses_the_batch_before_any_runs(server):
    client, state = server
    steps = []
    state.llm.engine.after_step_hooks.append(lambda: steps.append(1))
    too_long = [0] * 100_000
    r = client.post("/generate", json={"input_ids": [state.llm.encode("hi"), too_long],
                                       "sampling_params": GREEDY})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert not steps  # the good prompt never ran
    state.llm.engine.after_step_hooks.pop()
