"""One request-options layer for every route (tiermoe.server.request_options): each option does the same on every
route that has it (/v1/chat/completions, /v1/completions, /generate, Ollama's), shown by its effect on greedy or
seeded tokens of a tiny model; a bad value, a grammar, or an adapter that is not loaded is a 400 naming the field on
every route; docs/server-api.md holds exactly the table the code renders.

Every probe of a test is sent at once (the engine batches them), each a few tokens: the module takes a few seconds.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_thread import server_thread

from tiermoe.server.output_parsers import OutputParser
from tiermoe.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    SGLangGenerateRequest,
    SGLangSamplingParams,
)
from tiermoe.server.request_options import OPTIONS
from tiermoe.server.request_options_table import generated_part, options_tables

DOC = Path(__file__).resolve().parent.parent / "docs" / "server-api.md"
PROMPT = "abc"  # its greedy tokens repeat within 6, on both prompts (with and without the chat template)
EOS, BOS = 2, 1  # the tiny model's EOS and its tokenizer's <s> (a special token that is not EOS)
SAMPLED = {"temperature": 1.5, "seed": 5, "top_p": 1.0, "top_k": 0}  # seeded sampling, no filter
# route -> the path it is posted to, and how a request with PROMPT is made
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate",
          "ollama": "/api/generate"}
PROMPT_ROUTES = ("completions", "generate", "ollama")  # the same prompt ids: the same tokens for the same options


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with (server_thread(tmp_path_factory.mktemp("options"), max_running_requests=16, max_queued_requests=48) as (
            url, state), httpx.Client(base_url=url, timeout=120) as client):
        yield client, state


def body_of(route: str, options: dict, max_tokens: int = 6, **extra) -> dict:
    """A greedy request of PROMPT on `route` with `options` (by their keys in request_options.OPTIONS), each put in
    the request field that route declares for it: the layer's own declarations build the probes."""
    body = {"chat": {"messages": [{"role": "user", "content": PROMPT}]}, "completions": {"prompt": PROMPT},
            "generate": {"text": PROMPT, "sampling_params": {}},
            "ollama": {"prompt": PROMPT, "raw": True, "stream": False, "options": {}}}[route]
    for key, value in {"max_tokens": max_tokens, "temperature": 0, **options}.items():
        path = next(o for o in OPTIONS if o.key == key).fields[route][-1 if key == "max_tokens" else 0]
        *outer, name = path.split(".")
        (body[outer[0]] if outer else body)[name] = value
    return {**body, **extra}


def outcome(route: str, r: httpx.Response) -> tuple[str, int, str]:
    """(text, tokens generated, finish reason "stop" or "length") of a route's answer."""
    assert r.status_code == 200, r.text
    out = r.json()
    if route == "generate":
        return out["text"], out["meta_info"]["completion_tokens"], out["meta_info"]["finish_reason"]["type"]
    if route == "ollama":
        return out["response"], out["eval_count"], out["done_reason"]
    choice = out["choices"][0]
    text = choice["message"]["content"] if route == "chat" else choice["text"]
    return text, out["usage"]["completion_tokens"], choice["finish_reason"]


def post_all(client, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda request: client.post(*request[:1], json=request[1]), requests))


def token_of(state, text: str) -> int:
    [token] = state.llm.encode(text)
    return token


# option probe -> (its options, given the route's baseline and the server state; what the outcome must be)
PROBES = {
    "max_tokens": (lambda base, s: {"max_tokens": 2}, lambda base, s: (base[0][:2], 2, "length")),
    "stop": (lambda base, s: {"stop": [base[0][2]]},
             lambda base, s: (base[0][:base[0].index(base[0][2])], None, "stop")),
    "stop_token_ids": (lambda base, s: {"stop_token_ids": [token_of(s, base[0][1])]},
                       lambda base, s: (base[0][:base[0].index(base[0][1]) + 1], None, "stop")),
    "ignore_eos": (lambda base, s: {"logit_bias": {str(EOS): 100}, "ignore_eos": True, "max_tokens": 3},
                   lambda base, s: ("", 3, "length")),
    "logit_bias": (lambda base, s: {"logit_bias": {"50": 100}}, lambda base, s: (chr(50 + 29) * 6, 6, "length")),
    "min_tokens": (lambda base, s: {"logit_bias": {str(EOS): 100}, "min_tokens": 3}, lambda base, s: (None, 4, "stop")),
    "skip_special_tokens": (lambda base, s: {"logit_bias": {str(BOS): 100}, "skip_special_tokens": False,
                                             "max_tokens": 3}, lambda base, s: ("<s>" * 3, 3, "length")),
    "special_tokens_skipped": (lambda base, s: {"logit_bias": {str(BOS): 100}, "max_tokens": 3},
                               lambda base, s: ("", 3, "length")),
    "presence_penalty": (lambda base, s: {"presence_penalty": 2.0}, lambda base, s: "differs"),
    "frequency_penalty": (lambda base, s: {"frequency_penalty": 2.0}, lambda base, s: "differs"),
    "repetition_penalty": (lambda base, s: {"repetition_penalty": 3.0}, lambda base, s: "differs"),
    "seed": (lambda base, s: SAMPLED, lambda base, s: "differs"),
    "min_p": (lambda base, s: {**SAMPLED, "min_p": 1.0}, lambda base, s: base),
    "top_k": (lambda base, s: {**SAMPLED, "top_k": 1}, lambda base, s: base),
    "top_p": (lambda base, s: {**SAMPLED, "top_p": 1e-9}, lambda base, s: base),
}


def _routes_of(options: dict) -> list[str]:
    """The routes where every option of a probe exists."""
    return [route for route in ROUTES if all(route in next(o for o in OPTIONS if o.key == key).fields
                                             for key in options)]


def test_each_option_does_the_same_on_every_route_that_has_it(server):
    client, state = server
    baselines = dict(zip(ROUTES, (outcome(route, r) for route, r in zip(ROUTES, post_all(
        client, [(ROUTES[route], body_of(route, {})) for route in ROUTES])))))
    assert baselines["chat"][0] and len({baselines[route] for route in PROMPT_ROUTES}) == 1, baselines
    assert all(len(set(baselines[route][0])) < 6 for route in ("chat", "completions")), (
        "the penalties' probes need baselines that repeat a token", baselines)
    probes = [(name, route, body_of(route, **_max_tokens_aside(make(baselines[route], state))))
              for name, (make, _) in PROBES.items() for route in _routes_of(make(baselines["chat"], state))]
    answers = post_all(client, [(ROUTES[route], body) for _, route, body in probes])
    seen: dict[str, dict[str, tuple]] = {}
    for (name, route, _), r in zip(probes, answers):
        got, base = outcome(route, r), baselines[route]
        expected = PROBES[name][1](base, state)
        if expected == "differs":
            assert got[0] != base[0], (name, route, got)
        else:
            assert all(e is None or e == g for e, g in zip(expected, got)), (name, route, got, expected)
        seen.setdefault(name, {})[route] = got
    for name, by_route in seen.items():
        same_prompt = {by_route[route] for route in PROMPT_ROUTES if route in by_route}
        assert len(same_prompt) == 1, (name, by_route)
        assert "chat" in by_route and "completions" in by_route and "generate" in by_route, name
    assert {"ollama"} <= {route for name in ("presence_penalty", "repetition_penalty", "min_p", "seed")
                          for route in seen[name]}


def _max_tokens_aside(options: dict) -> dict:
    options = dict(options)
    max_tokens = options.pop("max_tokens", 6)
    return {"options": options, "max_tokens": max_tokens}


def test_n_gives_independent_choices_on_every_route(server):
    client, _ = server
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, **SAMPLED}
    one, two, streamed, completions, generate = post_all(client, [
        ("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "n": 2}),
        ("/v1/chat/completions", {**chat, "n": 2, "stream": True}),
        ("/v1/completions", {"prompt": [PROMPT, "abc"], "max_tokens": 4, "n": 2, **SAMPLED}),
        ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "n": 2, **_sglang(SAMPLED)}})])
    choices = two.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and two.json()["usage"]["completion_tokens"] == 8
    texts = [c["message"]["content"] for c in choices]
    assert texts[0] == one.json()["choices"][0]["message"]["content"] and texts[0] != texts[1]  # seed, seed + 1
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    pieces = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            pieces[choice["index"]] += choice["delta"].get("content", "")
    assert [pieces[0], pieces[1]] == texts
    listed = completions.json()["choices"]  # prompt x n + choice
    assert [c["index"] for c in listed] == [0, 1, 2, 3] and listed[0]["text"] != listed[1]["text"]
    assert completions.json()["usage"]["prompt_tokens"] == len(PROMPT) + len("abc")  # each prompt once
    by_generate = generate.json()
    assert isinstance(by_generate, list) and len(by_generate) == 2
    assert [o["text"] for o in by_generate] == [c["text"] for c in listed[:2]]


def _sglang(options: dict) -> dict:
    return {"sampling_seed" if k == "seed" else k: v for k, v in options.items()}


THINKING_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                     "{% if add_generation_prompt %}<s>assistant: "
                     "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template(server, monkeypatch):
    client, state = server
    monkeypatch.setattr(state.llm.tokenizer, "chat_template", THINKING_TEMPLATE)
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    plain, off = post_all(client, [("/v1/chat/completions", chat), (
        "/v1/chat/completions", {**chat, "chat_template_kwargs": {"enable_thinking": False}})])
    assert off.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] + len("<think></think>")


def test_continue_final_message_continues_the_last_assistant_message(server):
    client, state = server
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "ab"}]
    continued_ids = state.llm.chat_prompt_ids(messages, continue_final=True)
    assert state.llm.tokenizer.decode(continued_ids).endswith("assistant: ab")
    chat, completion = post_all(client, [
        ("/v1/chat/completions", {"messages": messages, "continue_final_message": True, "max_tokens": 4,
                                  "temperature": 0}),
        ("/v1/completions", {"prompt": continued_ids, "max_tokens": 4, "temperature": 0})])
    assert chat.json()["usage"]["prompt_tokens"] == len(continued_ids)
    assert chat.json()["choices"][0]["message"]["content"] == completion.json()["choices"][0]["text"]


def test_separate_reasoning_false_keeps_the_reasoning_in_the_content(server, monkeypatch):
    client, state = server
    monkeypatch.setitem(state.__dict__, "output_parser", OutputParser("deepseek-r1", None))  # all reasoning
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0}
    split, kept = (r.json()["choices"][0]["message"] for r in post_all(client, [
        ("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "separate_reasoning": False})]))
    assert split["reasoning_content"] and not split["content"]
    assert kept["content"] == split["reasoning_content"] and not kept.get("reasoning_content")


# (route, the request's fields, what the 400's message says)
REFUSED = [
    ("chat", {"logit_bias": {"x": 1}}, "logit_bias"), ("completions", {"logit_bias": {"999": 1}}, "logit_bias"),
    ("generate", {"sampling_params": {"logit_bias": {"5": 101}}}, "logit_bias.5: Input should be less than or equal"),
    ("chat", {"n": 0}, "n"), ("completions", {"n": 200}, "n"), ("completions", {"n": 100}, "n: 100 choices"),
    ("generate", {"sampling_params": {"n": 70}}, "n: 70 choices"),
    ("chat", {"min_p": 1.5}, "min_p"), ("ollama", {"options": {"min_p": -0.1}}, "options.min_p"),
    ("generate", {"sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("ollama", {"options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("chat", {"stop_token_ids": [999]}, "stop_token_ids: token id 999"),
    ("completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens: 5 is more than"),
    ("generate", {"sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}, "min_new_tokens: 5 is more than"),
    ("chat", {"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs: tokenize cannot be set"),
    ("chat", {"continue_final_message": True}, "continue_final_message needs"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("generate", {"sampling_params": {"json_schema": "{not json"}}, "json_schema: is not JSON"),
    ("ollama", {"format": "yaml"}, "format"),
    ("chat", {"ebnf": "root ::= \"a\"", "regex": "a"}, "regex, ebnf: each constrains the reply"),
    ("chat", {"model": "tiny:sql"}, "model: there is no LoRA adapter 'sql' on this server (none is loaded)"),
    ("completions", {"model": "tiny:sql"}, "model: there is no LoRA adapter 'sql'"),
    ("generate", {"lora_path": "sql"}, "lora_path: there is no LoRA adapter 'sql'"),
]


def test_bad_values_grammars_and_missing_adapters_are_a_400_naming_the_field(server):
    client, _ = server
    bodies = []
    for route, fields, _ in REFUSED:
        body = body_of(route, {}, max_tokens=2)
        for name, value in fields.items():
            body[name] = {**body[name], **value} if isinstance(value, dict) and isinstance(body.get(name), dict) \
                else value
        bodies.append((ROUTES[route], body))
    for (route, _, says), r in zip(REFUSED, post_all(client, bodies)):
        assert r.status_code == 400, (route, says, r.text)
        error = r.json()["error"]
        assert says in (error if route == "ollama" else error["message"]), (route, error)
    served = client.post("/v1/chat/completions", json={**body_of("chat", {}, max_tokens=1), "model": "tiny:latest"})
    assert served.status_code == 200, served.text  # the served model's own name (Ollama's tag) is no adapter


def test_the_doc_holds_the_tables_the_code_renders():
    assert generated_part(DOC.read_text()) == options_tables(), (
        "docs/server-api.md is stale: run python -m tiermoe.server.request_options_table docs/server-api.md")


# route -> (its request models, the model of its `sampling_params.` or `options.` fields)
ROUTE_MODELS = {"chat": ((ChatCompletionRequest,), None), "completions": ((CompletionRequest,), None),
                "generate": ((SGLangGenerateRequest,), SGLangSamplingParams),
                "ollama": ((OllamaChatRequest, OllamaGenerateRequest), OllamaOptions)}


@pytest.mark.parametrize("option", OPTIONS, ids=[o.key for o in OPTIONS])
def test_every_declared_field_is_a_field_of_its_routes_requests(option):
    for route, paths in option.fields.items():
        for path in paths:
            *outer, name = path.split(".")
            requests, nested = ROUTE_MODELS[route]
            for model in (nested,) if outer else requests:
                assert name in model.model_fields, (option.key, route, path, model.__name__)
