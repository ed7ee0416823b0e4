"""SGLang's native POST /generate (what KTransformers' collect_expert_distribution.py and SGLang's own scripts
call): `text` or `input_ids`, one prompt or a batch, `sampling_params`, streaming.

An answer is {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
...}}, a list of them for a batch. finish_reason is SGLang's object: {"type": "length", "length": N} or
{"type": "stop", "matched": TOKEN_ID or STOP_STRING}. A stream sends SSE `data: {...}` events with the text and
ids so far (each with "index" in a batch, as SGLang does), then `data: [DONE]`; a prompt that fails while it
streams sends `data: {"error": {...}}` in its place and the others go on. The text and ids so far are kept
JSON-encoded, each event encoding only its new piece (re-encoding all of them cost O(length) per token); with
--incremental-streaming-output (SGLang's flag) an event carries only its new text and ids.

A batch is checked whole before any prompt runs (as SGLang tokenises and validates every prompt first): one bad
prompt or sampling value is a 400 for the request. Its prompts then run concurrently, each its own engine request;
a batch takes an admission slot per prompt (503 with Retry-After when too few are free; 400 beyond
--max-running-requests + --max-queued-requests). sampling_params' `n` (the same for every prompt, as SGLang requires)
runs n sequences per prompt, and the answer is then a list of prompts x n (each prompt's n together, as SGLang
answers parallel sampling; `rid` + "-i" names choice i > 0). The sampling options are tiermoe.server.request_options'.
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
)
from tiermoe.server.request_options import (
    RequestOptions,
    check_sequences,
    choice_params,
    read_options,
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
    n = body.choices()
    options = [read_options("generate", body.one_prompt(i), state.model_name, state.adapters, state.llm.compile_grammar)
               for i in range(len(texts))]
    take_batch(request.scope, state.admission, check_sequences(state.config, len(texts), options[0]))  # a slot each
    prompts = [choice for i, text in enumerate(texts) for choice in await _prepare(state, body, options[i], i, text, n)]
    listed = body.is_batch() or n > 1  # a list answers; its events say their index
    if body.stream:
        return StreamingResponse(_stream(state, request, prompts, listed), media_type="text/event-stream")
    results = await asyncio.gather(*(collect(state, request, p.prompt_ids, p.params) for p in prompts),
                                   return_exceptions=True)
    for result in results:  # every prompt has ended: a failure answers for the request, as in SGLang
        if isinstance(result, BaseException):
            raise result
    outputs = [{"text": out.text, "output_ids": list(out.token_ids),
                "meta_info": _meta_info(p, len(out.token_ids), (out.token_ids or [None])[-1], out.finish_reason,
                                        out.stop_string)}
               for p, out in zip(prompts, results)]
    return outputs if listed else outputs[0]


async def _prepare(state: ServerState, body: SGLangGenerateRequest, options: RequestOptions, index: int,
                   text: str | list[int], n: int) -> list[_Prompt]:
    """Prompt `index`'s n choices, tokenised and checked."""
    prompt_ids = text if isinstance(text, list) else await state.tokenize(len(text), lambda: state.llm.encode(text))
    params = state.sampling(prompt_ids, options, SGLANG_SAMPLING, default_max_tokens=SGLANG_MAX_NEW_TOKENS)
    rid = body.request_id(index) or uuid.uuid4().hex
    return [_Prompt(rid if i == 0 else f"{rid}-{i}", prompt_ids, choice)
            for i, choice in enumerate(choice_params(params, n))]


def _meta_info(prompt: _Prompt, generated: int, last_id: int | None, finish: str | None,
               stop_string: str | None) -> dict:
    return {"id": prompt.rid, "finish_reason": _finish_reason(generated, last_id, finish, stop_string),
            "prompt_tokens": len(prompt.prompt_ids), "completion_tokens": generated, "cached_tokens": 0,
            "e2e_latency": time.monotonic() - prompt.started}


def _finish_reason(generated: int, last_id: int | None, finish: str | None, stop_string: str | None) -> dict | None:
    """SGLang's finish_reason object: what ended the generation (a stop string, else the last token: a stop id or
    EOS)."""
    if finish is None:
        return None
    if finish == "length":
        return {"type": "length", "length": generated}
    if finish != "stop":
        return {"type": "abort", "message": finish}
    return {"type": "stop", "matched": stop_string if stop_string is not None else last_id}


class _StreamedOutput:
    """One prompt's stream: its text and ids so far, JSON-encoded a piece at a time."""

    def __init__(self, prompt: _Prompt, incremental: bool):
        self.prompt, self.incremental = prompt, incremental
        self.text_json, self.ids_json = [], []  # each event's piece, encoded (json.dumps less its brackets)
        self.generated, self.last_id = 0, None

    def event(self, text: str, token_ids: list[int], finish: str | None, stop_string: str | None,
              where: dict) -> str:
        """An event's JSON: {"text", "output_ids", "meta_info"} and `where` (the prompt's index in a batch)."""
        text_json, ids_json = json.dumps(text)[1:-1], json.dumps(token_ids)[1:-1]
        if self.incremental:
            self.text_json, self.ids_json = [], []
        self.text_json.append(text_json)
        if ids_json:
            self.ids_json.append(ids_json)
        self.generated += len(token_ids)
        self.last_id = token_ids[-1] if token_ids else self.last_id
        meta = _meta_info(self.prompt, self.generated, self.last_id, finish, stop_string)
        return (f'{{"text": "{"".join(self.text_json)}", "output_ids": [{", ".join(self.ids_json)}], '
                f'"meta_info": {json.dumps(meta)}{"".join(f", {json.dumps(k)}: {v}" for k, v in where.items())}}}')


async def _stream(state: ServerState, request: Request, prompts: list[_Prompt], batch: bool) -> AsyncIterator[str]:
    outputs = [_StreamedOutput(p, state.config.incremental_streaming_output) for p in prompts]
    streams = [stream_events(state, request, p.prompt_ids, p.params) for p in prompts]
    async for index, event in merged_streams(streams):
        where = {"index": index} if batch else {}
        if event.error is not None:
            yield _sse({"error": {"message": f"generation failed: {event.error}", "code": event.error_status},
                        **where})
            continue
        yield _sse(outputs[index].event(event.text, event.token_ids, event.finish_reason, event.stop_string, where))
    yield _sse("[DONE]")


def _sse(payload: dict | str) -> str:
    """An SSE event of `payload` (a str is sent as it is: "[DONE]", or JSON already encoded)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

