"""SGLang's native POST /generate (what KTransformers' collect_expert_distribution.py and SGLang's own scripts
call): `text` or `input_ids`, one prompt or a batch, `sampling_params`, streaming.

An answer is {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
...}}, a list of them for a batch. finish_reason is SGLang's object: {"type": "length", "length": N} or
{"type": "stop", "matched": TOKEN_ID or STOP_STRING}. A stream sends SSE `data: {...}` events with the text and
ids so far (each with "index" in a batch, as SGLang does), then `data: [DONE]`; a prompt that fails while it
streams sends `data: {"error": {...}}` in its place and the others go on.

A batch is checked whole before any prompt runs (as SGLang tokenises and validates every prompt first): one bad
prompt or sampling value is a 400 for the request. Its prompts then run concurrently, each its own engine request;
a batch takes an admission slot per prompt (503 with Retry-After when too few are free; 400 beyond
--max-running-requests + --max-queued-requests).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tiermoe.engine.sampling import SamplingParams
from tiermoe.server.admission import take_batch
from tiermoe.server.body import openapi_body, read_body
from tiermoe.server.generation import collect, merged_streams, stream_events
from tiermoe.server.protocol import (
    SGLANG_MAX_NEW_TOKENS,
    SGLANG_SAMPLING,
    SGLangGenerateRequest,
    SGLangSamplingParams,
    no_top_k,
)
from tiermoe.server.state import ServerState

router = APIRouter()


class _Prompt:
    """One prompt of a request, checked and ready to run."""

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams):
        self.rid, self.prompt_ids, self.params = rid, prompt_ids, params
        self.started = time.monotonic()


@router.post("/generate", openapi_extra=openapi_body(SGLangGenerateRequest))
async def generate(request: Request):
    state: ServerState = request.app.state.tiermoe
    body = await read_body(request, SGLangGenerateRequest, state.config.max_request_bytes)
    texts = body.prompts()
    state.config.check_prompt_batch(len(texts))
    take_batch(request.scope, state.admission, len(texts))  # a slot each
    prompts = [await _prepare(state, body, i, text) for i, text in enumerate(texts)]
    if body.stream:
        return StreamingResponse(_stream(state, request, prompts, body.is_batch()), media_type="text/event-stream")
    results = await asyncio.gather(*(collect(state, request, p.prompt_ids, p.params) for p in prompts),
                                   return_exceptions=True)
    for result in results:  # every prompt has ended: a failure answers for the request, as in SGLang
        if isinstance(result, BaseException):
            raise result
    outputs = [_output(state, p, out.text, out.token_ids, out.finish_reason) for p, out in zip(prompts, results)]
    return outputs if body.is_batch() else outputs[0]


async def _prepare(state: ServerState, body: SGLangGenerateRequest, index: int, text: str | list[int]) -> _Prompt:
    prompt_ids = text if isinstance(text, list) else await state.tokenize(len(text), lambda: state.llm.encode(text))
    sp: SGLangSamplingParams = body.params(index)
    params = state.sampling(prompt_ids, sp.max_new_tokens, SGLANG_SAMPLING, default_max_tokens=SGLANG_MAX_NEW_TOKENS,
                            temperature=sp.temperature, top_p=sp.top_p, top_k=no_top_k(sp.top_k),
                            seed=sp.sampling_seed, stop=sp.stop_list(), stop_token_ids=tuple(sp.stop_token_ids or ()),
                            ignore_eos=sp.ignore_eos)
    return _Prompt(body.request_id(index) or uuid.uuid4().hex, prompt_ids, params)


def _output(state: ServerState, prompt: _Prompt, text: str, token_ids: list[int], finish: str | None) -> dict:
    return {"text": text, "output_ids": list(token_ids),
            "meta_info": {"id": prompt.rid, "finish_reason": _finish_reason(state, prompt, token_ids, finish),
                          "prompt_tokens": len(prompt.prompt_ids), "completion_tokens": len(token_ids),
                          "cached_tokens": 0, "e2e_latency": time.monotonic() - prompt.started}}


def _finish_reason(state: ServerState, prompt: _Prompt, token_ids: list[int], finish: str | None) -> dict | None:
    """SGLang's finish_reason object: what ended the generation."""
    if finish is None:
        return None
    if finish == "length":
        return {"type": "length", "length": len(token_ids)}
    if finish != "stop":
        return {"type": "abort", "message": finish}
    last, params = (token_ids[-1] if token_ids else None), prompt.params
    if last in params.stop_token_ids or (last in state.llm.engine.eos_token_ids and not params.ignore_eos):
        return {"type": "stop", "matched": last}
    full = state.llm.engine.detokenize(token_ids)  # the returned text ends before the stop string
    found = [(full.find(s), i) for i, s in enumerate(params.stop) if s in full]
    return {"type": "stop", "matched": params.stop[min(found)[1]] if found else None}


async def _stream(state: ServerState, request: Request, prompts: list[_Prompt], batch: bool) -> AsyncIterator[str]:
    texts, ids = [""] * len(prompts), [[] for _ in prompts]
    streams = [stream_events(state, request, p.prompt_ids, p.params) for p in prompts]
    async for index, event in merged_streams(streams):
        where = {"index": index} if batch else {}
        if event.error is not None:
            yield _sse({"error": {"message": f"generation failed: {event.error}", "code": event.error_status},
                        **where})
            continue
        texts[index] += event.text
        ids[index] += event.token_ids
        yield _sse({**_output(state, prompts[index], texts[index], ids[index], event.finish_reason), **where})
    yield _sse("[DONE]")


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

