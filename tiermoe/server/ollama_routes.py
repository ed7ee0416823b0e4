"""Ollama-compatible endpoints: /api/generate, /api/chat (NDJSON streams by default, as Ollama), /api/tags,
/api/show.

Names follow the server's one rule: whatever `model` a request names (or none), the loaded model answers, and every
reply names it (`model`: the served name). So /api/show describes the served model under any name, as /api/generate
answers under any name; a client configured for "llama3" works, and sees from the reply which model answered.

The final record (`done` true) carries Ollama's counts and durations, per request (tiermoe.server.ollama_durations):
`total_duration`, `load_duration`, `prompt_eval_count`, `prompt_eval_duration`, `eval_count`, `eval_duration`.

A request that fails while it generates gets Ollama's error body, {"error": "..."} (400 when its own values
caused it, else 500); a stream that fails ends with a final line that has done true, done_reason "error" and
the error: never a silent truncation. `logprobs`/`top_logprobs` (Ollama 0.12.11 and later) are answered in its
shape, a list of {token, logprob, bytes, top_logprobs} on each line.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tiermoe.server.body import openapi_body, read_body
from tiermoe.server.generation import GenerationFailed, collect, stream_events
from tiermoe.server.logprob_format import chat_logprobs
from tiermoe.server.model_card import (
    details,
    generation_parameters,
    model_info,
    modelfile,
)
from tiermoe.server.ollama_durations import ollama_durations
from tiermoe.server.ollama_reply import ChatReply, GenerateReply
from tiermoe.server.output_parsers import OutputParser
from tiermoe.server.protocol import (
    OLLAMA_SAMPLING,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from tiermoe.server.request_options import read_options
from tiermoe.server.request_timing import RequestTiming
from tiermoe.server.state import ServerState

router = APIRouter()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _params(state: ServerState, body, prompt_ids: list[int]):
    """The request's sampling, from its `options` and `format` (tiermoe.server.request_options)."""
    options = read_options("ollama", body, state.model_name, compile_grammar=state.llm.compile_grammar)
    return state.sampling(prompt_ids, options, OLLAMA_SAMPLING, logprobs=body.logprobs_asked())


def _final(state: ServerState, prompt_len: int, generated: int, reason: str, arrived: float,
           timing: RequestTiming | None) -> dict:
    """The last record's fields: Ollama's counts and durations in its order (the durations in nanoseconds)."""
    durations = ollama_durations(arrived, timing, time.monotonic())
    return {"model": state.model_name, "created_at": _now(), "done": True,
            "done_reason": reason if reason in ("length", "error") else "stop",
            "total_duration": durations["total_duration"], "load_duration": durations["load_duration"],
            "prompt_eval_count": prompt_len, "prompt_eval_duration": durations["prompt_eval_duration"],
            "eval_count": generated, "eval_duration": durations["eval_duration"]}


def _modified_at(state: ServerState) -> str:
    return datetime.fromtimestamp(state.started, timezone.utc).isoformat()


@router.get("/api/tags")
async def tags(request: Request):
    state: ServerState = request.app.state.tiermoe
    size = state.llm.hybrid.tier_bytes()
    return {"models": [{"name": state.model_name, "model": state.model_name, "modified_at": _modified_at(state),
                        "size": size.non_expert + size.gpu_experts + size.cpu_experts,
                        "details": details(state.llm, state.parameter_count)}]}


@router.post("/api/show", openapi_extra=openapi_body(OllamaShowRequest))
async def show(request: Request):
    state: ServerState = request.app.state.tiermoe
    await read_body(request, OllamaShowRequest, state.config.max_request_bytes)  # any name: the served model
    template = getattr(state.llm.tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else ""  # several named templates: none is "the" one
    parameters = generation_parameters(state.llm)
    return {"modelfile": modelfile(state.llm, template, parameters), "parameters": parameters,
            "template": template, "details": details(state.llm, state.parameter_count),
            "model_info": model_info(state.llm, state.parameter_count),
            "capabilities": ["completion", *(["tools"] if state.config.tool_call_parser else [])],
            "modified_at": _modified_at(state)}


async def _respond(state: ServerState, request: Request, prompt_ids, params, body, reply, arrived: float):
    def logprobs(scored) -> dict:
        return {"logprobs": chat_logprobs(state.token_text, scored)} if body.logprobs else {}

    if not body.stream:
        try:
            out = await collect(state, request, prompt_ids, params)
        except GenerationFailed as err:
            return JSONResponse(status_code=err.status, content={"error": f"generation failed: {err}"})
        return {**reply.whole(out.text),
                **_final(state, len(prompt_ids), len(out.token_ids), out.finish_reason, arrived, out.timing),
                **logprobs(out.logprobs)}

    async def lines():
        generated, reason, failed, held, timing = 0, "stop", {}, [], None
        async for event in stream_events(state, request, prompt_ids, params):
            generated += len(event.token_ids)
            reason = event.finish_reason or reason
            timing = event.timing or timing
            held += event.logprobs
            if event.error is not None:
                failed = {"error": f"generation failed: {event.error}"}
            piece = reply.delta(event.text, final=event.finish_reason is not None and event.error is None)
            if piece is not None:  # scores of tokens whose text is held back go out with the next text
                yield json.dumps({"model": state.model_name, "created_at": _now(), **piece,
                                  "done": False, **logprobs(held)}) + "\n"
                held = []
        yield json.dumps({**reply.empty(), **_final(state, len(prompt_ids), generated, reason, arrived, timing),
                          **failed, **(logprobs(held) if held else {})}) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/api/generate", openapi_extra=openapi_body(OllamaGenerateRequest))
async def generate(request: Request):
    arrived = time.monotonic()
    state: ServerState = request.app.state.tiermoe
    body = await read_body(request, OllamaGenerateRequest, state.config.max_request_bytes)
    if body.raw or not getattr(state.llm.tokenizer, "chat_template", None):
        prompt_ids = await state.tokenize(len(body.prompt), lambda: state.llm.encode(body.prompt))
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else [])
        messages.append({"role": "user", "content": body.prompt})
        prompt_ids = await state.tokenize(len(body.prompt) + len(body.system or ""),
                                          lambda: state.llm.chat_prompt_ids(messages))
    params = _params(state, body, prompt_ids)
    return await _respond(state, request, prompt_ids, params, body, GenerateReply(), arrived)


@router.post("/api/chat", openapi_extra=openapi_body(OllamaChatRequest))
async def chat(request: Request):
    arrived = time.monotonic()
    state: ServerState = request.app.state.tiermoe
    body = await read_body(request, OllamaChatRequest, state.config.max_request_bytes)
    messages = [m.for_template() for m in body.messages]
    tools = body.tools or None
    chars = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools)) if tools else 0)
    prompt_ids = await state.tokenize(chars, lambda: state.llm.chat_prompt_ids(messages, tools))
    params = _params(state, body, prompt_ids)
    kind = state.config.tool_call_parser
    return await _respond(state, request, prompt_ids, params, body,
                          ChatReply(OutputParser(None, kind) if tools and kind else None), arrived)
