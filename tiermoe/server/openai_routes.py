"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions (streaming over SSE and not), /v1/models.

Like SGLang, any `model` name in a request is served by the one loaded model. A request that fails while it
generates gets an error response (400 when its own values caused it, else 500); a stream that fails ends with a
chunk whose finish_reason is "error" and that carries an `error` object (the openai client raises it), then
[DONE]: never a silent truncation.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tiermoe.server.body import read_body
from tiermoe.server.generation import collect, stream_events
from tiermoe.server.protocol import ChatCompletionRequest, CompletionRequest
from tiermoe.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.tiermoe


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _error_object(event) -> dict:
    status = event.error_status
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"message": f"generation failed: {event.error}", "type": kind, "param": None, "code": status}


async def chat_prompt_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    return await state.tokenize(sum(len(m["content"]) for m in messages),
                                lambda: state.llm.chat_prompt_ids(messages))


async def completion_prompt_ids(state: ServerState, body: CompletionRequest) -> list[int]:
    if not isinstance(body.prompt, str):
        return body.prompt
    return await state.tokenize(len(body.prompt), lambda: state.llm.encode(body.prompt))


def _sampling(state: ServerState, body, prompt_ids: list[int], max_tokens: int | None):
    return state.sampling(prompt_ids, max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=max(0, body.top_k), seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos)


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                        "owned_by": "tiermoe", "max_model_len": state.context_length}]}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = _state(request)
    body = await read_body(request, ChatCompletionRequest, state.config.max_request_bytes)
    prompt_ids = await chat_prompt_ids(state, body)
    params = _sampling(state, body, prompt_ids, body.max_completion_tokens or body.max_tokens)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": state.model_name}
    if not body.stream:
        out = await collect(state, request, prompt_ids, params)
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "finish_reason": out.finish_reason, "logprobs": None}],
                "usage": _usage(len(prompt_ids), len(out.token_ids))}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks():
        chunk = {**head, "object": "chat.completion.chunk"}
        yield _sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None}]})
        generated = 0
        async for event in stream_events(state, request, prompt_ids, params):
            generated += len(event.token_ids)
            delta = {"content": event.text} if event.text else {}
            failed = {"error": _error_object(event)} if event.error is not None else {}
            yield _sse({**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": event.finish_reason}],
                        **failed})
        if include_usage:
            yield _sse({**chunk, "choices": [], "usage": _usage(len(prompt_ids), generated)})
        yield _sse("[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream")


@router.post("/v1/completions")
async def completions(request: Request):
    state = _state(request)
    body = await read_body(request, CompletionRequest, state.config.max_request_bytes)
    prompt_ids = await completion_prompt_ids(state, body)
    params = _sampling(state, body, prompt_ids, body.max_tokens)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    prefix = body.prompt if body.echo and isinstance(body.prompt, str) else ""
    if not body.stream:
        out = await collect(state, request, prompt_ids, params)
        return {**head, "choices": [{"index": 0, "text": prefix + out.text, "finish_reason": out.finish_reason,
                                     "logprobs": None}],
                "usage": _usage(len(prompt_ids), len(out.token_ids))}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks():
        generated = 0
        if prefix:
            yield _sse({**head, "choices": [{"index": 0, "text": prefix, "finish_reason": None, "logprobs": None}]})
        async for event in stream_events(state, request, prompt_ids, params):
            generated += len(event.token_ids)
            failed = {"error": _error_object(event)} if event.error is not None else {}
            yield _sse({**head, "choices": [{"index": 0, "text": event.text, "finish_reason": event.finish_reason,
                                             "logprobs": None}], **failed})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(len(prompt_ids), generated)})
        yield _sse("[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream")

