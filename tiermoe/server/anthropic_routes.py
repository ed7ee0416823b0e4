"""Anthropic's Messages API: `POST /v1/messages` (streaming as Anthropic's server-sent events, and not) and
`POST /v1/messages/count_tokens`, for the agents and coding tools that speak it (their base URL set to this
server).

The same chat template, reasoning and tool-call parsers (tiermoe.server.output_parsers) and forced tool calls
(tiermoe.server.forced_calls) as /v1/chat/completions, so a conversation gives the same greedy text on both; the
conversion of content blocks is tiermoe.server.anthropic_messages. `tool_choice` `any` and `tool` force a call
as OpenAI's `required` and a named function do. Errors have Anthropic's shape (tiermoe.server.error_format); a
stream that fails ends with an `error` event. Like every route here, any `model` name is served by the loaded
model, and the reply names that model.

A stream sends `message_start`, a `ping`, then one content block at a time (`content_block_start`, its deltas:
`thinking_delta`, `text_delta`, or one `input_json_delta` with a call's whole input, since a call is parsed once
the reply ends; `content_block_stop`), then `message_delta` (stop_reason, output tokens) and `message_stop`.
"""

from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tiermoe.errors import TiermoeError
from tiermoe.server.anthropic_messages import (
    Rendering,
    rendering,
    reply_blocks,
    stop_reason,
    tool_use_block,
)
from tiermoe.server.anthropic_protocol import (
    Conversation,
    CountTokensRequest,
    MessagesRequest,
)
from tiermoe.server.body import openapi_body, read_body
from tiermoe.server.error_format import anthropic_error_body
from tiermoe.server.forced_calls import ForcedCall, forced_call, reply_start
from tiermoe.server.generation import collect, stream_events
from tiermoe.server.output_parsers import OutputParser, Split, StreamSplitter
from tiermoe.server.request_options import RequestOptions
from tiermoe.server.state import ServerState

router = APIRouter()

# Anthropic's API defaults, where neither the request nor the checkpoint's generation_config.json gives a value.
ANTHROPIC_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def _state(request: Request) -> ServerState:
    return request.app.state.tiermoe


def openai_tool_choice(body: Conversation):
    """tool_choice as the forced-call code takes it (OpenAI's): "required", a named function, or None."""
    choice = body.tool_choice
    if choice is None or choice.type in ("auto", "none"):
        return None
    return "required" if choice.type == "any" else {"type": "function", "function": {"name": choice.name}}


async def prompt_of(state: ServerState, body: Conversation) -> tuple[list[int], Rendering, ForcedCall | None]:
    """The rendered prompt's ids (begun inside a tool call when tool_choice forces one), and how it was made."""
    tokenizer = state.llm.tokenizer
    if tokenizer is None:
        raise TiermoeError("this model has no tokenizer, so it takes no conversation (send token ids to /generate)")
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(
        tokenizer.chat_template)
    shown = rendering(body, template)
    choice, config = openai_tool_choice(body), state.config
    forced_call(choice, config.tool_call_parser, config.reasoning_parser, "")  # a 400 before rendering
    if choice is not None and shown.continue_final:
        raise TiermoeError("tool_choice forces a tool call, which cannot continue an assistant message (the "
                           "conversation ends with one): leave one of them out")
    calls = [m["tool_calls"] for m in shown.messages if "tool_calls" in m]
    chars = (sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in shown.messages)
             + (len(json.dumps(calls)) if calls else 0) + (len(json.dumps(shown.tools)) if shown.tools else 0))

    def render() -> tuple[list[int], ForcedCall | None]:
        ids = state.llm.chat_prompt_ids(shown.messages, shown.tools, shown.continue_final, shown.template_kwargs)
        tail = tokenizer.decode(ids[-16:], skip_special_tokens=False)
        forced = reply_start(choice, config.tool_call_parser, config.reasoning_parser, tail)
        return (ids + state.llm.encode(forced.prompt_suffix), forced) if forced else (ids, None)

    ids, forced = await state.tokenize(chars, render)
    return ids, shown, forced


def reply_parser(state: ServerState, shown: Rendering) -> OutputParser | None:
    """The server's parsers for this request: tool calls are looked for only when the request shows tools."""
    parser = state.output_parser
    if parser is None or shown.tools is not None or parser.tools is None:
        return parser
    return OutputParser(parser.reasoning, None) if parser.reasoning is not None else None


def message_head(state: ServerState, input_tokens: int) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": state.model_name,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}


@router.post("/v1/messages", openapi_extra=openapi_body(MessagesRequest))
async def messages(request: Request):
    state = _state(request)
    body = await read_body(request, MessagesRequest, state.config.max_request_bytes)
    prompt_ids, shown, forced = await prompt_of(state, body)
    head = message_head(state, len(prompt_ids))
    if body.max_tokens == 0:  # Anthropic's cache pre-warming: nothing to generate (prefix reuse is automatic)
        state.check_prompt(prompt_ids)
        done = {**head, "stop_reason": "max_tokens"}
        return StreamingResponse(_events_of_empty(done), media_type="text/event-stream") if body.stream else done
    options = RequestOptions("messages", max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                             top_k=body.top_k, stop=tuple(body.stop_sequences or ()))  # its strict schema: these only
    params = state.sampling(prompt_ids, options, ANTHROPIC_SAMPLING)
    parser = reply_parser(state, shown)
    prefix = forced.reply_prefix if forced else ""
    one_call = body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use
    if not body.stream:
        out = await collect(state, request, prompt_ids, params)
        split = parser.split(prefix + out.text, final=True) if parser else Split(content=out.text)
        blocks, uses = reply_blocks(split, one_call)
        reason, sequence = stop_reason(out.finish_reason, out.stop_string, uses > 0)
        return {**head, "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(out.token_ids)}}
    writer = BlockWriter()

    async def events():
        yield sse("message_start", {"type": "message_start", "message": head})
        yield sse("ping", {"type": "ping"})
        generated, splitter = 0, StreamSplitter(parser, prefix) if parser else None
        async for event in stream_events(state, request, prompt_ids, params):
            generated += len(event.token_ids)
            if event.error is not None:
                for chunk in writer.close():
                    yield chunk
                yield sse("error", anthropic_error_body(event.error_status, f"generation failed: {event.error}"))
                return
            final = event.finish_reason is not None
            if splitter is None:
                reasoning, content, calls = "", event.text, []
            else:
                reasoning, content, calls = splitter.feed(event.text, final=final)
            for chunk in writer.delta("thinking", reasoning) + writer.delta("text", content):
                yield chunk
            if final:
                uses = 0
                for call in calls:
                    use = tool_use_block(call) if not (one_call and uses) else None
                    as_text = f"{call['name']}({call['arguments']})"  # as reply_blocks keeps it
                    uses += use is not None
                    for chunk in writer.tool_use(use) if use else writer.delta("text", as_text):
                        yield chunk
                for chunk in writer.close():
                    yield chunk
                reason, sequence = stop_reason(event.finish_reason, event.stop_string, uses > 0)
                yield sse("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": {"output_tokens": generated}})
                yield sse("message_stop", {"type": "message_stop"})

    return StreamingResponse(events(), media_type="text/event-stream")


@router.post("/v1/messages/count_tokens", openapi_extra=openapi_body(CountTokensRequest))
async def count_tokens(request: Request):
    state = _state(request)
    body = await read_body(request, CountTokensRequest, state.config.max_request_bytes)
    prompt_ids, _, _ = await prompt_of(state, body)
    return {"input_tokens": len(prompt_ids)}


def sse(event: str, payload: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(payload)}\n\n"


async def _events_of_empty(done: dict):
    yield sse("message_start", {"type": "message_start", "message": {**done, "stop_reason": None}})
    yield sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens",
                                                                   "stop_sequence": None},
                                "usage": {"output_tokens": 0}})
    yield sse("message_stop", {"type": "message_stop"})


class BlockWriter:
    """A stream's content blocks, one open at a time: text and thinking grow by deltas; a tool_use is sent whole."""

    def __init__(self):
        self.index, self.open = -1, None  # the open block's index and type (None: none open)

    def delta(self, kind: str, text: str) -> list[str]:
        if not text:
            return []
        chunks = [] if self.open == kind else self.close() + self._start({"type": kind, kind: "", **(
            {"signature": ""} if kind == "thinking" else {})}, kind)
        field = "thinking_delta" if kind == "thinking" else "text_delta"
        return chunks + [sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                     "delta": {"type": field, kind: text}})]

    def tool_use(self, use: dict) -> list[str]:
        chunks = self.close() + self._start({**use, "input": {}}, "tool_use")
        chunks.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": {"type": "input_json_delta",
                                                            "partial_json": json.dumps(use["input"])}}))
        return chunks + self.close()

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict, kind: str) -> list[str]:
        self.index, self.open = self.index + 1, kind
        return [sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                            "content_block": block})]
