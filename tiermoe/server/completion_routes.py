"""OpenAI's POST /v1/completions: one prompt or several (a list of texts, or of token-id lists), as OpenAI and
SGLang take them, streamed over SSE or not.

Each prompt gives n choices (n 1 by default), `index` = its place in the list x n + the choice; `usage` adds up
every prompt. A batch is checked whole before any prompt runs (one bad prompt is a 400 for the request, as for
SGLang's /generate), then its choices run concurrently, each its own engine request; each takes an admission slot
(503 with Retry-After when too few are free; 400 beyond --max-running-requests + --max-queued-requests). A stream
interleaves the choices' chunks as they come. The sampling and request options are tiermoe.server.request_options'.
`echo` and `logprobs` (with max_tokens 0 to score a text, as evaluation harnesses do) apply to every prompt.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tiermoe.engine.sampling import SamplingParams
from tiermoe.server.admission import take_batch
from tiermoe.server.body import openapi_body, read_body
from tiermoe.server.generation import collect, merged_streams, stream_events
from tiermoe.server.logprob_format import completion_logprobs
from tiermoe.server.openai_routes import (
    openai_options,
    openai_sampling,
    sse,
    stream_error,
    usage_object,
)
from tiermoe.server.protocol import CompletionRequest
from tiermoe.server.request_options import (
    RequestOptions,
    check_sequences,
    choice_params,
)
from tiermoe.server.state import ServerState

router = APIRouter()


class _Prompt:
    """One choice of one prompt of the request, tokenised and checked: the prompt's text (what echo returns), ids
    and the choice's sampling."""

    def __init__(self, text: str, prompt_ids: list[int], params: SamplingParams):
        self.text, self.prompt_ids, self.params = text, prompt_ids, params


async def _prepare(state: ServerState, body: CompletionRequest, options: RequestOptions,
                   prompt: str | list[int]) -> list[_Prompt]:
    if isinstance(prompt, str):
        prompt_ids = await state.tokenize(len(prompt), lambda: state.llm.encode(prompt))
    else:
        prompt_ids = prompt
    # echo with logprobs scores the prompt too; max_tokens 0 (echo alone) has only the prompt to score
    scored_prompt = body.logprobs if body.echo and body.logprobs is not None else None
    if body.max_tokens == 0 and scored_prompt is None:
        scored_prompt = 0
    params = openai_sampling(state, options, prompt_ids, body.logprobs, scored_prompt)  # checks the ids
    text = prompt if isinstance(prompt, str) else ""
    if body.echo and not isinstance(prompt, str) and state.llm.tokenizer is not None:
        text = state.llm.tokenizer.decode(prompt)
    return [_Prompt(text, prompt_ids, choice) for choice in choice_params(params, options.n)]


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def completions(request: Request):
    state: ServerState = request.app.state.tiermoe
    body = await read_body(request, CompletionRequest, state.config.max_request_bytes)
    texts = body.prompts()
    options = openai_options(state, "completions", body)
    take_batch(request.scope, state.admission, check_sequences(state.config, len(texts), options))  # a slot each
    prompts = [choice for text in texts for choice in await _prepare(state, body, options, text)]
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}

    def choice(index: int, text: str, token_ids: list[int], scored: list, offset: int, finish: str | None) -> dict:
        logprobs = None if body.logprobs is None else completion_logprobs(state.token_text, token_ids, scored, offset)
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}

    def echoed(prompt: _Prompt, prompt_scores: list | None) -> tuple[str, list[int], list]:
        """The echoed prompt: its text, ids and scores (its first token has nothing before it to score it; none
        is scored when the request failed before its prompt was)."""
        if not body.echo:
            return "", [], []
        scores = [None, *(prompt_scores or ())]
        return prompt.text, prompt.prompt_ids, scores + [None] * (len(prompt.prompt_ids) - len(scores))

    if not body.stream:
        results = await asyncio.gather(*(collect(state, request, p.prompt_ids, p.params) for p in prompts),
                                       return_exceptions=True)
        for result in results:  # every prompt has ended: a failure answers for the request
            if isinstance(result, BaseException):
                raise result
        choices = []
        for index, (prompt, out) in enumerate(zip(prompts, results)):
            text, ids, scored = echoed(prompt, out.prompt_logprobs)
            choices.append(choice(index, text + out.text, ids + out.token_ids, scored + out.logprobs, 0,
                                  out.finish_reason))
        return {**head, "choices": choices, "usage": usage_object(_prompt_tokens(prompts, options.n),
                                                                   sum(len(out.token_ids) for out in results))}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks():
        generated, offsets, echo_pending = 0, [0] * len(prompts), [body.echo] * len(prompts)
        streams = [stream_events(state, request, p.prompt_ids, p.params) for p in prompts]
        async for index, event in merged_streams(streams):
            if echo_pending[index]:  # with the prompt's first event, which brings its scores
                echo_choice = choice(index, *echoed(prompts[index], event.prompt_logprobs), 0, None)
                yield sse({**head, "choices": [echo_choice]})
                offsets[index], echo_pending[index] = _end_offset(echo_choice["logprobs"], 0), False
            generated += len(event.token_ids)
            failed = {"error": stream_error(event)} if event.error is not None else {}
            event_choice = choice(index, event.text, event.token_ids, event.logprobs, offsets[index],
                                  event.finish_reason)
            yield sse({**head, "choices": [event_choice], **failed})
            offsets[index] = _end_offset(event_choice["logprobs"], offsets[index])
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage_object(_prompt_tokens(prompts, options.n), generated)})
        yield sse("[DONE]")

    return StreamingResponse(chunks(), media_type="text/event-stream")


def _prompt_tokens(prompts: list[_Prompt], n: int) -> int:
    """The request's prompt tokens: each prompt once, however many choices it has (as OpenAI and vLLM count)."""
    return sum(len(p.prompt_ids) for p in prompts[::n])


def _end_offset(logprobs: dict | None, offset: int) -> int:
    """Where the next chunk's text_offset starts: after this chunk's last token (offsets are only kept when
    logprobs are asked, so tokens are not decoded one by one otherwise)."""
    if not logprobs or not logprobs["tokens"]:
        return offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
