"""Sampling fields a caller leaves out come from the checkpoint's generation_config.json, in every entry point (the
Python API without SamplingParams, `tiermoe generate`, the OpenAI, SGLang and Ollama endpoints), as vLLM and SGLang
do; explicit values win, an explicit SamplingParams() stays greedy, and SGLang's /generate defaults to 128 tokens."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from conftest import run_cli, save_char_tokenizer, save_tiny
from server_thread import server_thread

from tiermoe.engine.engine import Engine
from tiermoe.engine.generation_defaults import GenerationDefaults, load_generation_defaults
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.bundled import resolve_model

QWEN3_STYLE = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 9}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("gen"))
    save_char_tokenizer(path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **QWEN3_STYLE}))
    return path


@pytest.fixture
def added(monkeypatch):
    """The SamplingParams of every sequence the engine is given."""
    seen = []
    original = Engine.add

    def spy(self, prompt_ids, params, *args, **kwargs):
        seen.append(params)
        return original(self, prompt_ids, params, *args, **kwargs)

    monkeypatch.setattr(Engine, "add", spy)
    return seen


def sampled(params: SamplingParams) -> tuple:
    return params.temperature, params.top_p, params.top_k


def test_the_file_is_read_and_bad_values_are_skipped(tmp_path):
    assert load_generation_defaults(tmp_path) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_p": 0.8, "top_k": 2.5}))
    with pytest.warns(UserWarning) as caught:
        defaults = load_generation_defaults(tmp_path)
    assert [str(w.message).split(": ", 1)[1] for w in caught] == [
        "temperature -1 is not a valid sampling default; ignored", "top_k 2.5 is not a valid sampling default; ignored"]
    assert defaults.sampling == {"top_p": 0.8}
    demo = load_generation_defaults(resolve_model(None))
    assert demo.sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 40} and demo.max_tokens == 256


def test_python_api_uses_the_defaults_only_without_sampling_params(model_dir, added):
    with LLM(model_dir, dtype=torch.float32, progress=False) as llm:
        llm.generate("hello")
        llm.generate("hello", SamplingParams(max_tokens=2))
        assert sampled(llm.default_sampling(temperature=0.0, top_k=None)) == (0.0, 0.95, 20)
    assert sampled(added[0]) == (0.6, 0.95, 20) and added[0].max_tokens == 9
    assert sampled(added[1]) == (0.0, 1.0, 0)  # an explicit SamplingParams() is greedy, as documented


def test_cli_generate_fills_only_what_the_flags_leave_out(model_dir, added):
    assert run_cli("generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2").returncode == 0
    assert run_cli("generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2", "--temperature",
                   "0", "--top-k", "3").returncode == 0
    assert [sampled(p) for p in added] == [(0.6, 0.95, 20), (0.0, 0.95, 3)]
    assert [p.max_tokens for p in added] == [2, 2]


REQUESTS = {  # path -> (body without sampling fields, the same with explicit ones, where the fields go)
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, None),
    "/v1/completions": ({"prompt": "hi", "max_tokens": 2}, None),
    "/generate": ({"text": "hi", "sampling_params": {"max_new_tokens": 2}}, "sampling_params"),
    "/api/generate": ({"prompt": "hi", "stream": False, "options": {"num_predict": 2}}, "options"),
    "/api/chat": ({"messages": [{"role": "user", "content": "hi"}], "stream": False, "options": {"num_predict": 2}},
                  "options"),
}
API_FALLBACKS = {"/v1/chat/completions": (1.0, 1.0, 0), "/v1/completions": (1.0, 1.0, 0), "/generate": (1.0, 1.0, 0),
                 "/api/generate": (0.8, 0.9, 40), "/api/chat": (0.8, 0.9, 40)}


def post(url: str, path: str, explicit: dict | None = None) -> None:
    body, inner = REQUESTS[path]
    body = json.loads(json.dumps(body))
    if explicit:
        (body[inner] if inner else body).update(explicit)
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_every_endpoint_takes_the_checkpoint_defaults_then_its_own(model_dir, added, tmp_path):
    with server_thread(tmp_path, model_dir=model_dir) as (url, state):
        for path in REQUESTS:
            post(url, path)
            post(url, path, {"temperature": 0, "top_k": 5})
        state.llm.generation_defaults = GenerationDefaults()  # a checkpoint without the file
        for path in REQUESTS:
            post(url, path)
        r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"temperature": 0}}, timeout=60)
        assert r.status_code == 200, r.text
    with_file, without = added[:2 * len(REQUESTS)], added[2 * len(REQUESTS):-1]
    assert [sampled(p) for p in with_file] == [(0.6, 0.95, 20), (0.0, 0.95, 5)] * len(REQUESTS)
    assert [sampled(p) for p in without] == [API_FALLBACKS[path] for path in REQUESTS]
    assert added[-1].max_tokens == 128  # SGLang's default max_new_tokens, not --default-max-tokens


def test_the_demo_model_samples_by_default(added):
    result = run_cli("generate", "--prompt", "Hello! What can you tell me about the ocean?",
                     "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert sampled(added[0]) == (0.7, 0.9, 40)
