"""A real server process, driven by the official openai client and by plain HTTP."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import torch
from conftest import save_char_tokenizer, save_tiny

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.testing.server_process import ServerProcess

KEY = "test-key"
PROMPTS = ["hello there", "what is the sea?", "a", "tell me a story about a dog and a cat"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("server-model"))
    save_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServerProcess(model_dir, "--api-key", KEY, "--chunked-prefill-size", "16", "--max-running-requests", "8",
                         "--num-gpu-experts", "3")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy answers of the Python API, in-process, with the same placement."""
    from tiermoe.config import PlacementConfig

    with LLM(model_dir, placement=PlacementConfig(num_gpu_experts=3), dtype=torch.float32, progress=False) as llm:
        chat = [llm.chat([{"role": "user", "content": p}], SamplingParams(max_tokens=12))[0].text for p in PROMPTS]
        completion = [llm.generate(p, SamplingParams(max_tokens=12))[0].text for p in PROMPTS]
    return {"chat": chat, "completion": completion}


def http(server, method: str, path: str, **kwargs) -> httpx.Response:
    headers = kwargs.pop("headers", {"Authorization": f"Bearer {KEY}"})
    return httpx.request(method, server.url + path, headers=headers, timeout=60, **kwargs)


def test_chat_streamed_and_not_equal_the_python_api(client, reference):
    for prompt, expected in zip(PROMPTS, reference["chat"]):
        messages = [{"role": "user", "content": prompt}]
        full = client.chat.completions.create(model="anything", messages=messages, max_tokens=12, temperature=0)
        assert full.choices[0].message.content == expected
        assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
        stream = client.chat.completions.create(model="x", messages=messages, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens == 12


def test_completions_streamed_and_not_equal_the_python_api(client, reference):
    for prompt, expected in zip(PROMPTS, reference["completion"]):
        full = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
        assert full.choices[0].text == expected
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt=prompt, max_tokens=12, temperature=0, stream=True))
        assert streamed == expected


def test_concurrent_requests_equal_sequential_ones(client, reference):
    results = [None] * len(PROMPTS)

    def ask(i):
        results[i] = client.completions.create(model="m", prompt=PROMPTS[i], max_tokens=12, temperature=0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.choices[0].text for r in results] == reference["completion"]


def test_stop_strings_end_the_answer_before_them(client, reference):
    expected = reference["completion"][0]
    stop = expected[5:7]
    out = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].text == expected[:expected.find(stop)] and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop], stream=True))
    assert streamed == expected[:expected.find(stop)]


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"prompt": 5, "max_tokens": 3}).encode(), "prompt"),
    (json.dumps({"prompt": "hi", "max_tokens": -1}).encode(), "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": 100000}).encode(), "max_tokens=100000 is too large"),
    (json.dumps({"prompt": "x" * 400, "max_tokens": 3}).encode(), "context is 256 tokens"),
    (json.dumps({"prompt": "hi", "n": 0}).encode(), "n"),
    (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), "temperature"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, fragment):
    r = http(server, "POST", "/v1/completions", content=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    # ignore_eos: the request samples (temperature 1), and an early end-of-text would shorten the answer
    ok = http(server, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_api_key_is_required_everywhere_but_health(server):
    assert http(server, "GET", "/health", headers={}).status_code == 200
    for path in ("/v1/models", "/metrics", "/placement", "/api/tags"):
        assert http(server, "GET", path, headers={}).status_code == 401
        assert http(server, "GET", path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http(server, "GET", path).status_code == 200
    assert http(server, "GET", "/v1/models", headers={}).json()["error"]["type"] == "authentication_error"


def test_ollama_endpoints(server, reference):
    r = http(server, "POST", "/api/generate", json={"prompt": PROMPTS[0], "raw": True, "stream": False,
                                                     "options": {"temperature": 0, "num_predict": 12}})
    assert r.status_code == 200 and r.json()["response"] == reference["completion"][0] and r.json()["done"]
    lines = [json.loads(x) for x in http(server, "POST", "/api/chat", json={
        "messages": [{"role": "user", "content": PROMPTS[1]}], "options": {"temperature": 0, "num_predict": 12},
    }).text.splitlines()]
    assert lines[-1]["done"] and lines[-1]["eval_count"] == 12
    assert "".join(x["message"]["content"] for x in lines) == reference["chat"][1]
    assert http(server, "GET", "/api/tags").json()["models"][0]["details"]["family"] == "qwen3_moe"


def test_models_placement_and_metrics(server):
    assert http(server, "POST", "/v1/completions", json={"prompt": "some traffic", "max_tokens": 3}).status_code == 200
    assert http(server, "GET", "/v1/models").json()["data"][0]["max_model_len"] == 256
    placement = http(server, "GET", "/placement").json()
    assert placement["gpu_experts_per_layer"] == [3, 0, 3] and 0 < placement["gpu_hit_rate"] < 1
    assert placement["per_layer_gpu_hit_rate"][1] is None and placement["swaps"] == 0
    assert [sum(1 for r in row if r == 0) for row in placement["assignment"]] == [3, 0, 3]
    metrics = http(server, "GET", "/metrics").text
    for name in ("requests_total", "generation_tokens_total", "time_to_first_token_seconds_sum",
                 "queue_length", "gpu_tier_hit_rate", "expert_swaps_total", "generation_tokens_per_second"):
        assert f"tiermoe_{name} " in metrics


def test_metrics_report_the_kv_pool_and_prefix_hits(server):
    prompt = "a long shared system prompt, then a question " * 3
    before = _metric(server, "prefix_cache_hit_tokens_total")
    for question in ("one?", "two?"):  # the second request finds the first one's full pages
        body = {"prompt": prompt + question, "max_tokens": 2}
        assert http(server, "POST", "/v1/completions", json=body).status_code == 200
    assert _metric(server, "prefix_cache_hit_tokens_total") - before >= 16
    assert _metric(server, "kv_pool_tokens") >= _metric(server, "kv_pool_used_tokens") >= 0
    assert _metric(server, "kv_pool_cached_prefix_tokens") >= 16
    assert _metric(server, "kv_pool_bytes_per_token") > 0 and _metric(server, "kv_pool_reserved_bytes") > 0


def _metric(server, name: str) -> float:
    for line in http(server, "GET", "/metrics").text.splitlines():
        if line.startswith(f"tiermoe_{name} "):
            return float(line.split()[1])
    raise KeyError(name)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    aborted = _metric(server, "requests_aborted_total")
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "hi", "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _metric(server, "requests_aborted_total") == aborted:
        time.sleep(0.1)
    assert _metric(server, "requests_aborted_total") == aborted + 1
    assert _metric(server, "running_requests") == 0


def test_sigterm_drains_running_streams_then_exits(model_dir):
    proc = ServerProcess(model_dir)
    received = []

    def consume():
        with httpx.stream("POST", proc.url + "/v1/completions", timeout=60,
                          json={"prompt": "hi", "max_tokens": 60, "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    received.append(json.loads(line[6:])["choices"][0])

    t = threading.Thread(target=consume)
    t.start()
    while not received:
        time.sleep(0.05)
    assert proc.stop(signal.SIGTERM) == 0
    t.join(timeout=30)
    assert received[-1]["finish_reason"] == "length"


def test_recorder_endpoints_need_a_mode(server):
    r = http(server, "POST", "/start_expert_distribution_record")
    assert r.status_code == 400 and "--expert-distribution-recorder-mode" in r.json()["error"]["message"]


def test_recorder_start_stop_dump_over_http(model_dir, tmp_path, monkeypatch):
    from tiermoe.stats.io import load_counts

    monkeypatch.setenv("TIERMOE_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path))
    proc = ServerProcess(model_dir, "--expert-distribution-recorder-mode", "stat")
    try:
        post = lambda path, **kw: httpx.post(proc.url + path, timeout=60, **kw)  # noqa: E731
        post("/v1/completions", json={"prompt": "not recorded", "max_tokens": 3})  # recording starts stopped
        assert post("/start_expert_distribution_record").status_code == 200
        out = post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "ignore_eos": True}).json()
        assert post("/stop_expert_distribution_record").status_code == 200
        files = post("/dump_expert_distribution_record").json()["files"]
        counts = load_counts(files[0], 3, 8)
        tokens = out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] - 1  # the last token is not fed
        assert int(counts.sum()) == tokens * 2 * 2  # top-2, two MoE layers
        assert files[0].startswith(str(tmp_path))
    finally:
        proc.stop()


def test_the_server_bounds_malloc_arenas_unless_the_user_chose(monkeypatch):
    import platform

    from tiermoe.server.malloc_arenas import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False  # the user's setting wins
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    if platform.libc_ver()[0] == "glibc":
        assert limit_malloc_arenas(8) is True  # a generous cap: harmless for the test process


KT_LAUNCH_LINE = ("--kt-weight-path /models/q-int4 --kt-cpuinfer 1 --kt-threadpool-count 2 --kt-num-gpu-experts 2 "
                  "--kt-method AMXINT8 --attention-backend triton --trust-remote-code --mem-fraction-static 0.98 "
                  "--chunked-prefill-size 64 --max-running-requests 4 --max-total-tokens 4096 --served-model-name kt "
                  "--enable-mixed-chunk --tensor-parallel-size 1 --enable-p2p-check --disable-shared-experts-fusion")


def test_a_ktransformers_launch_line_serves_and_names_the_flags_without_effect(model_dir):
    proc = ServerProcess(model_dir, *KT_LAUNCH_LINE.split())
    try:
        request = {"model": "x", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}  # sampled: EOS may come early
        body = httpx.post(proc.url + "/v1/completions", json=request, timeout=60).json()
        assert body["model"] == "kt" and body["usage"]["completion_tokens"] == 3
    finally:
        proc.stop()
    note = next(line for line in proc.log_tail().splitlines() if line.startswith("note: without effect in tiermoe:"))
    for flag in ("--kt-weight-path /models/q-int4", "--trust-remote-code", "--tensor-parallel-size 1"):
        assert flag in note
    # those take effect (CPU tier format, threads; attention: Triton's on CUDA, here on a CPU as "auto")
    assert "--kt-method" not in note and "--kt-cpuinfer" not in note and "--attention-backend" not in note
