"""OpenAI-compatible endpoints: /v1/chat/completions (streaming over SSE and not), /v1/models; /v1/completions is
tiermoe.server.completion_routes.

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
from tiermoe.server.forced_calls import ForcedCall, forced_call
from tiermoe.server.generation import collect, stream_events
from tiermoe.server.logprob_format import chat_logprobs
from tiermoe.server.output_parsers import OutputParser, StreamSplitter, tool_call_objects
from tiermoe.server.protocol import OPENAI_SAMPLING, ChatCompletionRequest, no_top_k
from tiermoe.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.tiermoe


def usage_object(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def stream_error(event) -> dict:
    status = event.error_status
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"message": f"generation failed: {event.error}", "type": kind, "param": None, "code": status}


def wants_tools(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


async def chat_prompt_ids(state: ServerState, body: ChatCompletionRequest) -> tuple[list[int], ForcedCall | None]:
    """The rendered prompt's ids, begun inside a tool call when `tool_choice` forces one (and how)."""
    messages = [m.for_template() for m in body.messages]
    tools = body.tools if wants_tools(body) else None
    chars = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools)) if tools else 0)
    config = state.config
    forced_call(body.tool_choice, config.tool_call_parser, config.reasoning_parser, "")  # a 400 before rendering

    def render() -> tuple[list[int], ForcedCall | None]:
        ids = state.llm.chat_prompt_ids(messages, tools)  # a template that raises: a 400 with its message
        tail = state.llm.tokenizer.decode(ids[-16:], skip_special_tokens=False)
        forced = forced_call(body.tool_choice, config.tool_call_parser, config.reasoning_parser, tail)
        return (ids + state.llm.encode(forced.prompt_suffix), forced) if forced else (ids, None)

    return await state.tokenize(chars, render)


def openai_sampling(state: ServerState, body, prompt_ids: list[int], max_tokens: int | None, logprobs: int | None,
              prompt_logprobs: int | None = None):
    return state.sampling(prompt_ids, max_tokens, OPENAI_SAMPLING, temperature=body.temperature, top_p=body.top_p,
                          top_k=no_top_k(body.top_k), seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def reply_parser(state: ServerState, body: ChatCompletionRequest) -> OutputParser | None:
    """The server's parser for this request: tool calls are looked for only when the request gives tools."""
    parser = state.output_parser
    if parser is None or wants_tools(body) or parser.tools is None:
        return parser
    return OutputParser(parser.reasoning, None) if parser.reasoning is not None else None


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                        "owned_by": "tiermoe", "max_model_len": state.context_length}]}


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
async def chat_completions(request: Request):
    state = _state(request)
    body = await read_body(request, ChatCompletionRequest, state.config.max_request_bytes)
    prompt_ids, forced = await chat_prompt_ids(state, body)
    reply_prefix = forced.reply_prefix if forced else ""  # the call's opening, which the prompt holds
    params = openai_sampling(state, body, prompt_ids, body.max_completion_tokens or body.max_tokens, body.logprobs_asked())

    def logprobs(scored) -> dict | None:
        return {"content": chat_logprobs(state.token_text, scored)} if body.logprobs else None

    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": state.model_name}
    parser = reply_parser(state, body)
    if not body.stream:
        out = await collect(state, request, prompt_ids, params)
        message, finish = {"role": "assistant", "content": out.text}, out.finish_reason
        if parser is not None:
            split = parser.split(reply_prefix + out.text, final=True)
            message["content"] = split.content if split.content or not split.tool_calls else None
            message["reasoning_content"] = split.reasoning or None
            if split.tool_calls:
                message["tool_calls"] = tool_call_objects(split.tool_calls)
                finish = "tool_calls" if finish == "stop" else finish
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": logprobs(out.logprobs)}],
                "usage": usage_object(len(prompt_ids), len(out.token_ids))}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks():
        chunk = {**head, "object": "chat.completion.chunk"}
        yield sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None}]})
        generated, splitter = 0, StreamSplitter(parser, reply_prefix) if parser is not None else None
        async for event in stream_events(state, request, prompt_ids, params):
            generated += len(event.token_ids)
            finish, delta = event.finish_reason, {"content": event.text} if event.text else {}
            if splitter is not None:
                final = finish is not None and event.error is None
                reasoning, content, calls = splitter.feed(event.text, final=final)
                delta = {**({"reasoning_content": reasoning} if reasoning else {}),
                         **({"content": content} if content else {})}
                if calls:
                    delta["tool_calls"] = tool_call_objects(calls, streamed=True)
                    finish = "tool_calls" if finish == "stop" else finish
            failed = {"error": stream_error(event)} if event.error is not None else {}
            yield sse({**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                              "logprobs": logprobs(event.logprobs)}], **failed})
        if include_usage:
            yield sse({**chunk, "choices": [], "usage": usage_object(len(prompt_ids), generated)})
        yield sse("[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream")
