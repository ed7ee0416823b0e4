"""Structured output through the routes on the bundled demo model (issue: replies and request options, class 3):
schema-constrained replies parse and validate, on every route's field; an unsupported schema feature is a 400
naming it; a reply cut by max_tokens reports `length`; an unconstrained request beside constrained ones keeps its
tokens."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_thread import server_thread
from test_engine_structured_output import SCHEMA, validate

from tiermoe.bundled import resolve_model

pytest.importorskip("llguidance", reason="the structured extra: pip install 'tiermoe[structured]'")

SCHEMAS = [  # nested objects, arrays, enums, required fields; free strings bounded (a 12M model rambles in them)
    SCHEMA,
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer",
                                                                                        "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
]
PROMPTS = ["Describe a customer.", "Is the sky blue?", "List an order.", "Hello!", "What is 2+2?"]
UNSUPPORTED = [  # (path, body fields, the 400 says)
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "array", "uniqueItems": True}}}},
     'response_format: json_schema: unsupported JSON-schema keyword(s): "uniqueItems"'),
    ("/v1/completions", {"prompt": "x", "regex": "(?=a)a"}, 'regex: regex: invalid regex "(?=a)a": look-around'),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": '{"type": "object", "not": {}}'}},
     'sampling_params.json_schema: json_schema: unsupported JSON-schema keyword(s): "not"'),
    ("/api/generate", {"prompt": "x", "format": {"type": "object", "if": {}, "then": {}}},
     'format: json_schema: unsupported JSON-schema keyword(s): "if", "then"'),
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    with (server_thread(tmp_path_factory.mktemp("structured"), model_dir=resolve_model(None),
                        max_running_requests=16) as (url, state),
          httpx.Client(base_url=url, timeout=120) as client):
        yield client, state


def chat(schema: dict, prompt: str, seed: int, max_tokens: int = 200) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.8, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def post_all(client, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda request: client.post(request[0], json=request[1]), requests))


def test_fifty_schema_constrained_replies_all_parse_against_their_schema(demo):
    client, _ = demo
    asked = [(i % len(SCHEMAS), chat(SCHEMAS[i % len(SCHEMAS)], PROMPTS[i % len(PROMPTS)], seed=i)) for i in range(50)]
    replies = post_all(client, [("/v1/chat/completions", body) for _, body in asked])
    for (which, _), r in zip(asked, replies):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice  # the grammar ended it, well within max_tokens
        validate(json.loads(choice["message"]["content"]), SCHEMAS[which])


def test_every_route_holds_its_reply_to_its_grammar(demo):
    client, _ = demo
    regex = r"[a-z]{3,8}-\d{2}"
    ebnf = 'root ::= "colour: " ("red" | "green" | "blue")'
    r = client.post("/generate", json={"text": "Pick one.", "sampling_params": {"regex": regex, "max_new_tokens": 40,
                                                                                  "temperature": 1.0}})
    assert r.status_code == 200 and re.fullmatch(regex, r.json()["text"]), r.text
    r = client.post("/v1/completions", json={"prompt": "Colour?", "ebnf": ebnf, "max_tokens": 20})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("colour: red", "colour: green", "colour: blue")
    r = client.post("/api/generate", json={"model": "m", "prompt": "Sure?", "format": SCHEMAS[1], "stream": False,
                                           "options": {"num_predict": 60}})
    assert r.status_code == 200, r.text
    validate(json.loads(r.json()["response"]), SCHEMAS[1])
    with client.stream("POST", "/v1/chat/completions", json={**chat(SCHEMAS[1], "Yes?", 3), "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    validate(json.loads("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)), SCHEMAS[1])


@pytest.mark.parametrize("path, fields, says", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_a_schema_feature_that_cannot_be_enforced_is_a_400_naming_it(demo, path, fields, says):
    client, _ = demo
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **fields}
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in (error if isinstance(error, str) else error["message"])


def test_a_reply_cut_by_max_tokens_reports_length(demo):
    client, _ = demo
    r = client.post("/v1/chat/completions", json=chat(SCHEMAS[0], PROMPTS[0], seed=1, max_tokens=5))
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "length"
    with pytest.raises(ValueError):
        json.loads(choice["message"]["content"])


def test_an_unconstrained_request_beside_constrained_ones_keeps_its_tokens(demo):
    client, _ = demo
    plain = {"prompt": "The weather today is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = client.post("/v1/completions", json=plain).json()["choices"][0]["text"]
    together = post_all(client, [("/v1/completions", plain)] +
                        [("/v1/chat/completions", chat(SCHEMAS[i % 3], "Hi", seed=i)) for i in range(6)])
    assert together[0].json()["choices"][0]["text"] == alone
    assert all(r.status_code == 200 for r in together)


def test_ignore_eos_goes_on_while_the_grammar_allows_more_and_stops_where_it_is_complete(demo):
    client, _ = demo
    request = {"prompt": "Tell me about the city number 3.", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    open_ended = client.post("/v1/completions", json=request | {"regex": "[a-z ]+"}).json()["choices"][0]
    assert open_ended["finish_reason"] == "length" and re.fullmatch("[a-z ]+", open_ended["text"])
    complete = client.post("/v1/completions", json=request | {"regex": "[a-z]{3}"}).json()["choices"][0]
    assert complete["finish_reason"] == "stop" and re.fullmatch("[a-z]{3}", complete["text"])
