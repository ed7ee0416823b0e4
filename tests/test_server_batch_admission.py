"""A batch takes an admission slot per prompt (issue: serving under hostile load, class 1): 10 batches of 80 once
put 768 sequences in a queue of 128 and held a lone chat request's first token for 219 s. Now a batch larger than
the free slots is a 503 with Retry-After, larger than all of them a 400, and its slots come back when it ends."""

from __future__ import annotations

import time

import httpx
import pytest
from server_thread import server_thread

from tiermoe.server.admission import (
    BATCH_SLOTS,
    Admission,
    AdmissionRefused,
    take_batch,
)


def test_a_batch_takes_a_slot_per_prompt_and_gives_them_back():
    admission, scope = Admission(4, 2, 2), {}
    assert admission.enter()  # the request's own slot (the middleware's)
    take_batch(scope, admission, 4)
    assert admission.in_flight == 4 and scope["state"][BATCH_SLOTS] == 3
    assert not admission.enter()
    admission.leave(1 + scope["state"].pop(BATCH_SLOTS))
    assert admission.enter() and admission.enter()  # two requests: two slots free
    with pytest.raises(AdmissionRefused, match="2 of its 4 slots are taken .* a batch of 4 prompts; retry after"):
        take_batch({}, admission, 4)  # its own slot and 3 more: one too many
    assert admission.in_flight == 2


def slots_back(state, within_s: float = 5.0) -> bool:
    """Whether every slot is free again: the middleware gives them back once the response is sent, which may be
    just after the client has it."""
    deadline = time.monotonic() + within_s
    while state.admission.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    return state.admission.in_flight == 0


def test_batches_are_answered_by_the_free_slots_and_release_them(tmp_path):
    with server_thread(tmp_path, max_running_requests=2, max_queued_requests=1) as (url, state):
        done = httpx.post(url + "/generate", json={"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 2}},
                          timeout=60)
        assert done.status_code == 200 and len(done.json()) == 3
        assert slots_back(state)  # every prompt's
        assert state.admission.enter()  # one held elsewhere: two free
        busy = httpx.post(url + "/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2}, timeout=60)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
        assert "a batch of 3 prompts" in busy.json()["error"]["message"]
        state.admission.leave()
        too_big = httpx.post(url + "/v1/completions", json={"prompt": ["a"] * 4, "max_tokens": 2}, timeout=60)
        assert too_big.status_code == 400 and "more than this server holds at once" in too_big.text
        assert slots_back(state)


def test_a_lone_request_is_admitted_beside_a_big_batch_not_behind_it(tmp_path):
    """The engine admits round-robin across requests: with 2 running slots, a batch of 6 queued first, a lone
    request queued after it starts at the first step (it used to wait for the whole batch)."""
    import torch
    from conftest import save_tiny

    from tiermoe.engine.llm import LLM
    from tiermoe.engine.sampling import SamplingParams

    with LLM(save_tiny("qwen3_moe", tmp_path), dtype=torch.float32, max_running=2, progress=False) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        batch = [engine.add([5, 6, 7], params, group=1) for _ in range(6)]
        lone = engine.add([8, 9], params)
        engine.step()
        assert engine.running == [batch[0], lone]
        engine.run_to_completion()
        assert all(len(s.output_ids) == 3 for s in [*batch, lone])
