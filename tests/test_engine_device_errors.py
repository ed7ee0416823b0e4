"""A sticky device error (a poisoned CUDA context) stops the engine at once; a dead engine thread stops the server.

On CUDA an illegal memory access, a device-side assert or a launch failure makes every later call fail the same
way: bisecting the step would blame every sequence and leave a server that answers /health while nothing can
succeed. The errors are injected here as torch raises them (torch.AcceleratorError, CUDA's own text).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from server_thread import server_thread

from tiermoe.engine import engine as engine_module
from tiermoe.engine.device_errors import DeviceLostError, sticky_device_error
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.server.engine_service import EngineThreadDied

ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered\nCompile with `TORCH_USE_CUDA_DSA` ..."
PROMPTS = [[5, 6, 7], [20, 21], [30, 31, 32, 33], [40]]


def sticky(message: str = ILLEGAL_ADDRESS) -> torch.AcceleratorError:
    return torch.AcceleratorError(message)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, progress=False) as llm:
        yield llm


@pytest.mark.parametrize("error, is_sticky", [
    (sticky(), True),
    (sticky("CUDA error: device-side assert triggered"), True),
    (RuntimeError("Triton Error [CUDA]: unspecified launch failure"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (sticky("CUDA error: invalid argument"), False),
    (ValueError("an illegal memory access was encountered"), False),
])
def test_only_the_errors_that_poison_the_context_are_sticky(error, is_sticky):
    assert (sticky_device_error(error) is error) == is_sticky
    wrapped = ValueError("a step failed")
    wrapped.__cause__ = error
    assert (sticky_device_error(wrapped) is error) == is_sticky


def test_a_sticky_error_in_the_forward_is_fatal_at_once_without_bisecting(llm, monkeypatch):
    engine = llm.engine
    calls = []

    def forward(batch, inputs):
        calls.append(len(batch))
        raise sticky()

    monkeypatch.setattr(engine, "_recorded_forward", forward)
    seqs = [engine.add(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in PROMPTS]
    with pytest.raises(DeviceLostError, match="unrecoverable error .*an illegal memory access") as err:
        engine.step()
    assert err.value.fatal and "\n" not in str(err.value)
    assert calls == [len(PROMPTS)]  # one forward, no halves re-run on the poisoned context
    for seq in seqs:
        engine.abort(seq)
    assert not engine.has_work()


def test_a_sticky_error_surfacing_at_the_sampler_is_fatal_too(llm, monkeypatch):
    def sample(*args, **kwargs):  # an asynchronous fault shows at the first sync: the sampled token's .item()
        raise sticky("CUDA error: unspecified launch failure")

    monkeypatch.setattr(engine_module, "sample", sample)
    engine = llm.engine
    seqs = [engine.add(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in PROMPTS[:2]]
    with pytest.raises(DeviceLostError, match="unspecified launch failure"):
        engine.step()
    for seq in seqs:
        engine.abort(seq)


def test_a_sticky_error_fails_the_running_requests_marks_the_server_unhealthy_and_stops_it(tmp_path, monkeypatch):
    with server_thread(tmp_path) as (url, state):
        stopped = []
        state.service.on_fatal = stopped.append
        assert httpx.get(url + "/health").status_code == 200
        monkeypatch.setattr(state.llm.engine, "_recorded_forward", lambda batch, inputs: (_ for _ in ()).throw(
            sticky()))
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 500 and "unrecoverable error" in r.json()["error"]["message"]
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "illegal memory access" in health.json()["error"]
        assert len(stopped) == 1 and isinstance(stopped[0], DeviceLostError)
        later = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert later.status_code == 500


def test_an_error_that_kills_the_engine_thread_takes_the_same_exit(tmp_path, monkeypatch, caplog):
    with server_thread(tmp_path) as (url, state):
        stopped = []
        state.service.on_fatal = stopped.append

        def emit(seq):
            raise KeyError("emitting a token")

        monkeypatch.setattr(state.service, "_emit", emit)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 500 and "engine thread stopped" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
        assert len(stopped) == 1 and isinstance(stopped[0], EngineThreadDied)
