"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions (streaming over SSE and not), /v1/models.

Like SGLang, any `model` name in a request is served by the one loaded model. A request that fails while it
generates gets an error response (400 when its own values caused it, else 500); a stream that fails ends with a
chunk whose finish_reason is "error" and that carries an `error` object (the openai client raises it), then
[DONE]: never a silent truncation. `logprobs`/`top_logprobs` and `echo` (with max_tokens 0 to score a text, as
evaluation harnesses do) are answered in the API's shapes (tiermoe.server.logprob_format).
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tiermoe.server.body import openapi_body, read_body
from tiermoe.server.generation import collect, stream_events
from tiermoe.server.logprob_format import chat_logprobs, completion_logprobs
from tiermoe.server.protocol import OPENAI_SAMPLING, ChatCompletionRequest, CompletionRequest, no_top_k
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
    messages = [m.for_template() for m in body.messages]
    return await state.tokenize(sum(len(m["content"]) for m in messages),
                                lambda: state.llm.chat_prompt_ids(messages))


async def completion_prompt_ids(state: ServerState, body: CompletionRequest) -> list[int]:
    if not isinstance(body.prompt, str):
        return body.prompt
    return await state.tokenize(len(body.prompt), lambda: state.llm.encode(body.prompt))


def _sampling(state: ServerState, body, prompt_ids: list[int], max_tokens: int | None, logprobs: int | None,
              prompt_logprobs: int | None = None):
    return state.sampling(prompt_ids, max_tokens, OPENAI_SAMPLING, temperature=body.temperature, top_p=body.top_p,
                          top_k=no_top_k(body.top_k), seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs)


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                        "owned_by": "tiermoe", "max_model_len": state.context_length}]}


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
async def chat_completions(request: Request):
    state = _state(request)
    body = await read_body(request, ChatCompletionRequest, state.config.max_request_bytes)
    prompt_ids = await chat_prompt_ids(state, body)
    params = _sampling(state, body, prompt_ids, body.max_completion_tokens or body.max_tokens, body.logprobs_asked())

    def logprobs(scored) -> dict | None:
        return {"content": chat_logprobs(state.token_text, scored)} if body.logprobs else None

    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": state.model_name}
    if not body.stream:
        out = await collect(state, request, prompt_ids, params)
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "finish_reason": out.finish_reason, "logprobs": logprobs(out.logprobs)}],
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
            yield _sse({**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": event.finish_reason,
                                              "logprobs": logprobs(event.logprobs)}], **failed})
        if include_usage:
            yield _sse({**chunk, "choices": [], "usage": _usage(len(prompt_ids), generated)})
        yield _sse("[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream")


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def completions(request: Request):
    state = _state(request)
    body = await read_body(request, CompletionRequest, state.config.max_request_bytes)
    prompt_ids = await completion_prompt_ids(state, body)
    # echo with logprobs scores the prompt too; max_tokens 0 (echo alone) has only the prompt to score
    scored_prompt = body.logprobs if body.echo and body.logprobs is not None else None
    if body.max_tokens == 0 and scored_prompt is None:
        scored_prompt = 0
    params = _sampling(state, body, prompt_ids, body.max_tokens, body.logprobs, scored_prompt)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}

    def choice(text: str, token_ids: list[int], scored: list, offset: int, finish_reason: str | None) -> dict:
        logprobs = None if body.logprobs is None else completion_logprobs(state.token_text, token_ids, scored, offset)
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}

    def echoed(prompt_scores: list | None) -> tuple[str, list[int], list]:
        """The echoed prompt: its text, ids and scores (its first token has nothing before it to score it; none
        is scored when the request failed before its prompt was)."""
        scores = [None, *(prompt_scores or ())]
        return _prompt_text(state, body), prompt_ids, scores + [None] * (len(prompt_ids) - len(scores))

    if not body.stream:
        out = await collect(state, request, prompt_ids, params)
        text, ids, scored = echoed(out.prompt_logprobs) if body.echo else ("", [], [])
        return {**head, "choices": [choice(text + out.text, ids + out.token_ids, scored + out.logprobs, 0,
                                           out.finish_reason)],
                "usage": _usage(len(prompt_ids), len(out.token_ids))}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks():
        generated, offset, echo_pending = 0, 0, body.echo
        async for event in stream_events(state, request, prompt_ids, params):
            if echo_pending:  # with the first event, which brings the prompt's scores
                text, ids, scored = echoed(event.prompt_logprobs)
                echo_choice = choice(text, ids, scored, 0, None)
                yield _sse({**head, "choices": [echo_choice]})
                offset, echo_pending = _end_offset(echo_choice["logprobs"], offset), False
            generated += len(event.token_ids)
            failed = {"error": _error_object(event)} if event.error is not None else {}
            event_choice = choice(event.text, event.token_ids, event.logprobs, offset, event.finish_reason)
            yield _sse({**head, "choices": [event_choice], **failed})
            offset = _end_offset(event_choice["logprobs"], offset)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(len(prompt_ids), generated)})
        yield _sse("[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream")


def _prompt_text(state: ServerState, body: CompletionRequest) -> str:
    if isinstance(body.prompt, str):
        return body.prompt
    return state.llm.tokenizer.decode(body.prompt) if state.llm.tokenizer is not None else ""


def _end_offset(logprobs: dict | None, offset: int) -> int:
    """Where the next chunk's text_offset starts: after this chunk's last token (offsets are only kept when
    logprobs are asked, so tokens are not decoded one by one otherwise)."""
    if not logprobs or not logprobs["tokens"]:
        return offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
