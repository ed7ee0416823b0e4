"""A tiermoe server in this process (uvicorn on a thread) around a tiny fp32 model: the tests can reach into
its state (metrics, engine) and its log records reach pytest's caplog (uvicorn's own logging config is off)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch
import uvicorn
from conftest import save_char_tokenizer, save_tiny

from tiermoe.config import ServerConfig
from tiermoe.distributed.launch import free_port
from tiermoe.engine.llm import LLM
from tiermoe.server.app import create_app
from tiermoe.server.engine_service import EngineService
from tiermoe.server.expert_metrics import ExpertLoadCounter
from tiermoe.server.idle_connections import idle_closing_h11
from tiermoe.server.metrics import ServerMetrics
from tiermoe.server.state import ServerState
from tiermoe.stats.tier_hits import TierHitCounter

# A small good request for each POST endpoint (two tokens, not streamed).
GOOD_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/api/chat": {"messages": [{"role": "user", "content": "hi"}], "stream": False, "options": {"num_predict": 2}},
    "/api/generate": {"prompt": "hi", "stream": False, "options": {"num_predict": 2}},
    "/v1/messages": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


def error_of(path: str, r) -> tuple[str | None, str]:
    """(error type, message) of an error response in its API's format: Ollama's a string (no type), Anthropic's
    {"type": "error", "error": {"type", "message"}}, OpenAI's and SGLang's an object whose code is the status."""
    body = r.json()
    if path.startswith("/api/"):
        return None, body["error"]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]["type"], body["error"]["message"]
    assert body["error"]["code"] == r.status_code, body
    return body["error"]["type"], body["error"]["message"]


@contextmanager
def listening(app, port: int, **uvicorn_config):
    """Yields the URL of uvicorn serving `app` on 127.0.0.1:`port` from a thread, once it has started; stops it
    after the block."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, log_level="warning",
                                           **uvicorn_config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def server_thread(tmp_dir, step_sleep: float = 0.0, model_dir=None, **config):
    """Yields (url, state). `step_sleep` seconds after every engine step make generation slow enough to watch;
    `model_dir` serves that model (in fp32) instead of a tiny one with a character tokenizer."""
    path = model_dir
    if path is None:
        path = save_tiny("qwen3_moe", tmp_dir)
        save_char_tokenizer(path)
    llm = LLM(path, dtype=torch.float32, prefill_chunk=16, max_running=config.get("max_running_requests", 8),
              progress=False)
    if step_sleep:
        llm.engine.after_step_hooks.append(lambda: time.sleep(step_sleep))
    server_config = ServerConfig(port=free_port(), **config)
    metrics = ServerMetrics()
    expert_load = None
    if server_config.expert_distribution_metrics:  # as tiermoe.cli.serve_http.build_state wires it
        expert_load = ExpertLoadCounter(llm.hybrid.spec.num_layers, llm.hybrid.spec.num_experts)
        llm.engine.add_recorder(expert_load)
    service = EngineService(llm.engine, metrics,
                            watchdog_timeout=server_config.watchdog_timeout)
    state = ServerState(llm=llm, config=server_config, metrics=metrics, model_name="tiny", service=service,
                        hits=TierHitCounter(llm.hybrid.spec.num_layers), expert_load=expert_load)
    try:
        with listening(create_app(state), server_config.port, timeout_keep_alive=server_config.keep_alive_timeout,
                       http=idle_closing_h11(server_config.body_timeout)) as url:
            yield url, state
    finally:
        llm.close()
