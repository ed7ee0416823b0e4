"""`logprobs`, `top_logprobs` and `echo` over HTTP: the numbers are the unmodified transformers model's (fp32),
streamed or not, in each API's shape, and the official openai client parses them; max_tokens 0 with echo scores a
text as evaluation harnesses ask."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from conftest import load_reference
from server_thread import server_thread

PROMPT = [40, 41, 42, 43, 44, 45]  # token ids: the char tokenizer maps ids 3.. to characters


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("logprobs")) as (url, state):
        reference = load_reference(state.llm.model_dir)
        yield url, state, reference


def model_logprobs(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)


def completion(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "temperature": 0, "ignore_eos": True, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_echo_with_logprobs_scores_prompt_and_answer_like_transformers(served):
    url, state, reference = served
    choice = completion(url, max_tokens=3, echo=True, logprobs=2)["choices"][0]
    ids = [state.llm.tokenizer.convert_tokens_to_ids(t) for t in choice["logprobs"]["tokens"]]
    assert ids[:len(PROMPT)] == PROMPT and len(ids) == len(PROMPT) + 3
    expected = model_logprobs(reference, ids)
    scores = choice["logprobs"]["token_logprobs"]
    assert scores[0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert scores[1:] == pytest.approx([float(expected[t - 1, ids[t]]) for t in range(1, len(ids))], abs=1e-5)
    for t in range(1, len(ids)):  # the 2 most likely alternatives, plus the chosen token
        top = choice["logprobs"]["top_logprobs"][t]
        best = [state.token_text(i) for i in expected[t - 1].topk(2).indices.tolist()]
        assert set(best) <= set(top) and choice["logprobs"]["tokens"][t] in top
    text = choice["text"]
    assert text.startswith(state.llm.tokenizer.decode(PROMPT))
    assert choice["logprobs"]["text_offset"] == [sum(map(len, choice["logprobs"]["tokens"][:t]))
                                                 for t in range(len(ids))]


def test_max_tokens_zero_with_echo_only_scores_the_prompt(served):
    url, _, reference = served
    body = completion(url, max_tokens=0, echo=True, logprobs=0)
    choice = body["choices"][0]
    expected = model_logprobs(reference, PROMPT)
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [float(expected[t - 1, PROMPT[t]]) for t in range(1, len(PROMPT))], abs=1e-5)
    assert len(choice["logprobs"]["tokens"]) == len(PROMPT)


def test_streamed_logprobs_equal_the_whole_answer(served):
    url, _, _ = served
    whole = completion(url, max_tokens=4, echo=True, logprobs=1)["choices"][0]["logprobs"]
    chunks = streamed(url, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "ignore_eos": True,
                                                "max_tokens": 4, "echo": True, "logprobs": 1})
    pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in pieces for x in p[key]] == whole[key]


def test_chat_logprobs_parse_with_the_openai_client_and_match_the_stream(served):
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "hello"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=3).choices[0]
    content = answer.logprobs.content
    assert "".join(entry.token for entry in content) == answer.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    chunks = streamed(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0,
                                                    "logprobs": True, "top_logprobs": 3})
    from_stream = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert [(e["token"], e["logprob"]) for e in from_stream] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("path, body", [
    ("/api/generate", {"prompt": "hello", "raw": True}),
    ("/api/chat", {"messages": [{"role": "user", "content": "hello"}]}),
])
def test_ollama_logprobs_one_per_token(served, path, body):
    url, _, _ = served
    body = {**body, "logprobs": True, "top_logprobs": 2, "options": {"num_predict": 3, "temperature": 0}}
    whole = httpx.post(url + path, json={**body, "stream": False}, timeout=60).json()
    assert len(whole["logprobs"]) == whole["eval_count"] == 3
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in whole["logprobs"])
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [e for line in lines for e in line.get("logprobs", [])] == whole["logprobs"]
