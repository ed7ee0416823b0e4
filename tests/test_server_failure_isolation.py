"""A request that fails while it generates gets an error (in the stream: an error chunk and a finish reason, then
[DONE]); the requests running beside it finish, complete and exactly as alone. Values the engine cannot take are
refused at the edge (400 naming the field) or given a defined meaning (tiny temperatures are greedy).

The server runs in this process (uvicorn on a thread), so a fault can be planted in the model: any forward whose
input holds the POISON character fails in its last decoder layer, as a bad value inside the step would.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
import uvicorn
from conftest import save_char_tokenizer, save_tiny

from tiermoe.config import ServerConfig
from tiermoe.distributed.launch import free_port
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.server.app import create_app
from tiermoe.server.engine_service import EngineService
from tiermoe.server.metrics import ServerMetrics
from tiermoe.server.state import ServerState
from tiermoe.stats.tier_hits import TierHitCounter

GOOD = "tell me a story about a dog"
TOKENS = 40


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("isolation-model"))
    save_char_tokenizer(path)
    llm = LLM(path, dtype=torch.float32, prefill_chunk=16, max_running=8, progress=False)
    greedy = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    reference = llm.generate(llm.encode(GOOD), greedy)[0]
    # a character that neither the good prompt nor its answer holds: only the bad requests feed it
    poison = next(c for c in "~^|`{}" if llm.encode(c)[0] not in reference.token_ids and c not in GOOD)
    poison_id = llm.encode(poison)[0]
    local = threading.local()

    def look(module, args):
        local.poisoned = bool((args[0] == poison_id).any())

    def fail(module, args, kwargs):
        if getattr(local, "poisoned", False):
            raise ValueError("poisoned token")

    model = llm.hybrid.model
    model.get_input_embeddings().register_forward_pre_hook(look)
    model.model.layers[-1].register_forward_pre_hook(fail, with_kwargs=True)
    llm.engine.after_step_hooks.append(lambda: time.sleep(0.01))  # a good stream lasts long enough to overlap

    config = ServerConfig(port=free_port())
    metrics = ServerMetrics()
    state = ServerState(llm=llm, config=config, service=EngineService(llm.engine, metrics),
                        metrics=metrics, hits=TierHitCounter(llm.hybrid.spec.num_layers), model_name="tiny")
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=config.port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield {"url": f"http://127.0.0.1:{config.port}", "reference": reference.text, "poison": poison,
           "poison_id": poison_id}
    server.should_exit = True
    thread.join(timeout=30)
    llm.close()


def post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(served["url"] + path, json=body, timeout=60)


def sse(served, path: str, body: dict, into: list, arrived: list | None = None) -> None:
    """Read an SSE stream into `into` (the JSON of each chunk, "[DONE]" as a string), noting when lines arrive."""
    with httpx.stream("POST", served["url"] + path, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                into.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if arrived is not None:
                    arrived.append(time.monotonic())


def good_body() -> dict:
    return {"prompt": GOOD, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}


def start_good_stream(served):
    chunks, arrived = [], []
    thread = threading.Thread(target=sse, args=(served, "/v1/completions", good_body(), chunks, arrived))
    thread.start()
    while len(chunks) < 3:  # it is decoding: the bad request joins its steps
        time.sleep(0.005)
    return thread, chunks, arrived


def assert_good_stream_complete(chunks, served):
    assert chunks[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == served["reference"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert not any("error" in c for c in chunks[:-1])


def test_a_failing_stream_says_so_and_the_stream_beside_it_is_complete_and_exact(served):
    thread, good, good_arrived = start_good_stream(served)
    bad: list = []
    sse(served, "/v1/completions", {"prompt": "hi " + served["poison"], "max_tokens": 10, "temperature": 0}, bad)
    bad_ended = time.monotonic()
    thread.join()
    assert bad[-1] == "[DONE]"
    last = bad[-2]
    assert last["choices"][0]["finish_reason"] == "error"
    assert last["error"] == {"message": "generation failed: ValueError: poisoned token", "type": "server_error",
                             "param": None, "code": 500}
    assert bad_ended < good_arrived[-1]  # the two ran together
    assert_good_stream_complete(good, served)


def test_a_failing_chat_stream_raises_in_the_openai_client(served):
    from openai import APIError, OpenAI

    client = OpenAI(base_url=served["url"] + "/v1", api_key="none", max_retries=0)
    thread, good, _ = start_good_stream(served)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": served["poison"]}],
                                            max_tokens=10, temperature=0, stream=True)
    with pytest.raises(APIError, match="poisoned token"):
        list(stream)
    thread.join()
    assert_good_stream_complete(good, served)


def test_a_failing_request_that_does_not_stream_gets_an_error_response_in_its_apis_format(served):
    results = {}
    good = threading.Thread(target=lambda: results.setdefault("good", post(served, "/v1/completions", good_body())))
    good.start()
    time.sleep(0.1)
    bad = post(served, "/v1/completions", {"prompt": served["poison"], "max_tokens": 5})
    assert bad.status_code == 500
    assert bad.json()["error"]["message"] == "generation failed: ValueError: poisoned token"
    assert bad.json()["error"]["type"] == "server_error"
    ollama = post(served, "/api/generate", {"prompt": served["poison"], "raw": True, "stream": False})
    assert (ollama.status_code, ollama.json()) == (500, {"error": "generation failed: ValueError: poisoned token"})
    good.join()
    assert results["good"].status_code == 200
    assert results["good"].json()["choices"][0]["text"] == served["reference"]


def test_a_failing_ollama_stream_ends_with_a_done_line_that_carries_the_error(served):
    r = post(served, "/api/chat", {"messages": [{"role": "user", "content": served["poison"]}],
                                   "options": {"temperature": 0, "num_predict": 5}})
    last = json.loads(r.text.splitlines()[-1])
    assert (r.status_code, last["done"], last["done_reason"]) == (200, True, "error")
    assert last["error"] == "generation failed: ValueError: poisoned token"


def test_prompt_ids_outside_the_vocabulary_are_a_400_naming_the_prompt(served):
    for ids, shown in (([5, 256], "256 at position 1"), ([-3], "-3 at position 0")):
        r = post(served, "/v1/completions", {"prompt": ids, "max_tokens": 3})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (f"prompt: token id {shown} is outside the model's vocabulary "
                                                "(0 to 255)")
    ok = post(served, "/v1/completions", good_body())
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == served["reference"]


@pytest.mark.parametrize("sampling", [{"temperature": 1e-40}, {"temperature": 5e-324},
                                      {"temperature": 1.0, "top_p": 1e-50}])
def test_sampling_values_too_small_to_compute_with_have_a_defined_meaning(served, sampling):
    # a temperature below 1e-5 is greedy; a top_p below every probability keeps the most likely token
    r = post(served, "/v1/completions", {**good_body(), **sampling, "seed": 1})
    assert r.status_code == 200
    assert (r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]) == (served["reference"], "length")
