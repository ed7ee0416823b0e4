"""Several prompts in one /v1/completions request (a list of texts or of token-id lists), as OpenAI and SGLang
take them: one choice per prompt with the same greedy tokens as the prompt alone, usage over all, streamed or not,
echo and logprobs per prompt, a bad prompt a 400 for the whole request."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_thread import server_thread

GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
PROMPTS = ["hello", "the sea is", "abc"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("batch")) as (url, state):
        with httpx.Client(base_url=url, timeout=60) as client:
            alone = [client.post("/v1/completions", json={"prompt": p, **GREEDY}).json() for p in PROMPTS]
            yield client, state, alone


def test_a_list_of_texts_or_ids_is_one_choice_per_prompt(served):
    client, state, alone = served
    for prompt in (PROMPTS, [state.llm.encode(p) for p in PROMPTS]):
        r = client.post("/v1/completions", json={"prompt": prompt, **GREEDY})
        assert r.status_code == 200, r.text
        out = r.json()
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert [c["text"] for c in out["choices"]] == [a["choices"][0]["text"] for a in alone]
        assert out["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
        assert out["usage"]["completion_tokens"] == 4 * len(PROMPTS)


def test_a_streamed_batch_interleaves_the_prompts(served):
    client, _, alone = served
    body = {"prompt": PROMPTS, **GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts, finished = [""] * len(PROMPTS), set()
    for chunk in chunks[:-1]:
        [c] = chunk["choices"]
        texts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finished.add(c["index"])
    assert texts == [a["choices"][0]["text"] for a in alone] and finished == {0, 1, 2}
    assert chunks[-1]["usage"]["completion_tokens"] == 4 * len(PROMPTS)


def test_echo_and_logprobs_apply_to_each_prompt(served):
    client, _, alone = served
    r = client.post("/v1/completions", json={"prompt": PROMPTS[:2], **GREEDY, "echo": True, "logprobs": 1})
    for prompt, single, c in zip(PROMPTS, alone, r.json()["choices"]):
        assert c["text"] == prompt + single["choices"][0]["text"]
        assert len(c["logprobs"]["tokens"]) == len(prompt) + 4 and c["logprobs"]["token_logprobs"][0] is None


@pytest.mark.parametrize("prompt, fragment", [(["ok", "a" * 100_000], "characters"), ([[5, 6], []], "empty"),
                                              ([], "empty")])
def test_one_bad_prompt_refuses_the_whole_batch(served, prompt, fragment):
    client, _, _ = served
    r = client.post("/v1/completions", json={"prompt": prompt, **GREEDY})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_the_openai_client_gets_every_choice(served):
    client, _, alone = served
    api = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="x")
    out = api.completions.create(model="tiny", prompt=PROMPTS, max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [a["choices"][0]["text"] for a in alone]
