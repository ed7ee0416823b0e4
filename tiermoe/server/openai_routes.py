"""OpenAI-compatible endpoints: /v1/chat/completions (streaming over SSE and not), /v1/models; /v1/completions is
tiermoe.server.completion_routes.

Like SGLang, any `model` name in a request is served by the one loaded model. A request that fails while it
generates gets an error response (400 when its own values caused it, else 500); a stream that fails ends with a
chunk whose finish_reason is "error" and that carries an `error` object (the openai client raises it), then
[DONE]: never a silent truncation. `logprobs`/`top_logprobs` and `echo` (with max_tokens 0 to score a text, as
evaluation harnesses do) are answered in the API's shapes (tiermoe.server.logprob_format). The sampling and request
options (penalties, logit_bias, n, chat_template_kwargs, ...) are read by tiermoe.server.request_options; with n > 1
each choice is its own sequence (an admission slot each), and a stream interleaves their chunks by `index`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.server.admission import take_batch
from tiermoe.server.body import openapi_body, read_body
from tiermoe.server.forced_calls import ForcedCall, forced_call, reply_start
from tiermoe.server.generation import collect, merged_streams, stream_events
from tiermoe.server.logprob_format import chat_logprobs
from tiermoe.server.output_parsers import (
    OutputParser,
    StreamSplitter,
    tool_call_objects,
)
from tiermoe.server.protocol import OPENAI_SAMPLING, ChatCompletionRequest
from tiermoe.server.request_options import (
    RequestOptions,
    check_sequences,
    choice_params,
    read_options,
)
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


async def chat_prompt_ids(state: ServerState, body: ChatCompletionRequest,
                          options: RequestOptions) -> tuple[list[int], ForcedCall | None]:
    """The rendered prompt's ids (with the request's chat_template_kwargs, continuing its last message when
    continue_final_message asks), begun inside a tool call when `tool_choice` forces one (and how)."""
    messages = [m.for_template() for m in body.messages]
    tools = body.tools if wants_tools(body) else None
    chars = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools)) if tools else 0)
    config = state.config
    forced_call(body.tool_choice, config.tool_call_parser, config.reasoning_parser, "")  # a 400 before rendering
    continue_final = options.continue_final_message
    if continue_final and body.tool_choice not in (None, "none", "auto"):
        raise TiermoeError("continue_final_message: tool_choice forces a tool call, which cannot continue an "
                           "assistant message; leave one of them out")

    def render() -> tuple[list[int], ForcedCall | None]:
        # a template that raises: a 400 with its message
        ids = state.llm.chat_prompt_ids(messages, tools, continue_final, options.chat_template_kwargs)
        tail = state.llm.tokenizer.decode(ids[-16:], skip_special_tokens=False)
        forced = reply_start(body.tool_choice, config.tool_call_parser, config.reasoning_parser, tail)
        return (ids + state.llm.encode(forced.prompt_suffix), forced) if forced else (ids, None)

    return await state.tokenize(chars, render)


def openai_options(state: ServerState, route: str, body) -> RequestOptions:
    """The request's options (tiermoe.server.request_options): `model` "<served name>:NAME" names an adapter."""
    return read_options(route, body, state.model_name, state.adapters, state.llm.compile_grammar)


def openai_sampling(state: ServerState, options: RequestOptions, prompt_ids: list[int], logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    return state.sampling(prompt_ids, options, OPENAI_SAMPLING, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def reply_parser(state: ServerState, body: ChatCompletionRequest, options: RequestOptions) -> OutputParser | None:
    """The server's parser for this request: tool calls are looked for only when the request gives tools, and
    reasoning only when it does not turn separate_reasoning off (then the reasoning stays in the content)."""
    parser = state.output_parser
    if parser is None:
        return None
    reasoning = parser.reasoning if options.separate_reasoning else None
    tools = parser.tools if wants_tools(body) else None
    if (reasoning, tools) == (parser.reasoning, parser.tools):
        return parser
    return OutputParser(reasoning, tools) if reasoning is not None or tools is not None else None


@router.get("/v1/models")
async def models(request: Request):
    """The served model, then each LoRA adapter served per request as vLLM lists them (`root` its directory,
    `parent` the served model): a client may name either as `model`."""
    state = _state(request)
    served = state.llm.engine.adapters
    card = {"object": "model", "created": int(state.started), "owned_by": "tiermoe",
            "max_model_len": state.context_length}
    adapters = [{"id": name, **card, "root": path, "parent": state.model_name}
                for name, path in sorted((served.paths() if served is not None else {}).items())]
    return {"object": "list", "data": [{"id": state.model_name, **card}, *adapters]}


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
async def chat_completions(request: Request):
    state = _state(request)
    body = await read_body(request, ChatCompletionRequest, state.config.max_request_bytes)
    options = openai_options(state, "chat", body)
    take_batch(request.scope, state.admission, check_sequences(state.config, 1, options))  # a slot per choice
    prompt_ids, forced = await chat_prompt_ids(state, body, options)
    reply_prefix = forced.reply_prefix if forced else ""  # the call's opening, which the prompt holds
    params = choice_params(openai_sampling(state, options, prompt_ids, body.logprobs_asked()), options.n)

    def logprobs(scored) -> dict | None:
        return {"content": chat_logprobs(state.token_text, scored)} if body.logprobs else None

    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": state.model_name}
    parser = reply_parser(state, body, options)
    if not body.stream:
        results = await asyncio.gather(*(collect(state, request, prompt_ids, p) for p in params),
                                       return_exceptions=True)
        for result in results:  # every choice has ended: a failure answers for the request
            if isinstance(result, BaseException):
                raise result
        choices = [_choice(index, out, parser, reply_prefix, logprobs) for index, out in enumerate(results)]
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": usage_object(len(prompt_ids), sum(len(out.token_ids) for out in results))}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks():
        chunk = {**head, "object": "chat.completion.chunk"}
        yield sse({**chunk, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None} for index in range(len(params))]})
        generated = 0
        splitters = [StreamSplitter(parser, reply_prefix) if parser is not None else None for _ in params]
        streams = [stream_events(state, request, prompt_ids, p) for p in params]
        async for index, event in merged_streams(streams):
            generated += len(event.token_ids)
            finish, delta = event.finish_reason, {"content": event.text} if event.text else {}
            if splitters[index] is not None:
                final = finish is not None and event.error is None
                reasoning, content, calls = splitters[index].feed(event.text, final=final)
                delta = {**({"reasoning_content": reasoning} if reasoning else {}),
                         **({"content": content} if content else {})}
                if calls:
                    delta["tool_calls"] = tool_call_objects(calls, streamed=True)
                    finish = "tool_calls" if finish == "stop" else finish
            failed = {"error": stream_error(event)} if event.error is not None else {}
            yield sse({**chunk, "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                              "logprobs": logprobs(event.logprobs)}], **failed})
        if include_usage:
            yield sse({**chunk, "choices": [], "usage": usage_object(len(prompt_ids), generated)})
        yield sse("[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream")


def _choice(index: int, out, parser: OutputParser | None, reply_prefix: str, logprobs) -> dict:
    """One choice of a whole (not streamed) reply: its text split by the parser."""
    message, finish = {"role": "assistant", "content": out.text}, out.finish_reason
    if parser is not None:
        split = parser.split(reply_prefix + out.text, final=True)
        message["content"] = split.content if split.content or not split.tool_calls else None
        message["reasoning_content"] = split.reasoning or None
        if split.tool_calls:
            message["tool_calls"] = tool_call_objects(split.tool_calls)
            finish = "tool_calls" if finish == "stop" else finish
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs(out.logprobs)}
