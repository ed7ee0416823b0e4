"""The requests of the mixed soak (benchmarks/soak_mixed.py): a pool of good greedy requests over every endpoint,
streamed and not, each read back as (text, token count, finish reason); and the kinds of bad request, each sent as
raw bytes and answered by a status (or, for a client that leaves mid-stream, by no status at all).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Callable

import httpx

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/api/generate", "/api/chat")
CHAT = ("/v1/chat/completions", "/api/chat")
OLLAMA = ("/api/generate", "/api/chat")
PROMPTS = ("Once upon a time", "The capital of France is", "Write a haiku about the sea.",
           "List three prime numbers:", "Why is the sky blue?", "def fibonacci(n):")
MAX_TOKENS = (8, 16, 24, 32)
RAW = "@@raw@@"  # a JSON string replaced by raw bytes after encoding (for bodies json.dumps cannot write)


def body(path: str, prompt, max_tokens=None, stream: bool = False, **sampling) -> dict:
    """A request body for `path`: the prompt as a user message on the chat endpoints, sampling fields at the top
    level (OpenAI) or under `options` (Ollama, where max_tokens is num_predict)."""
    out: dict = {"messages": [{"role": "user", "content": prompt}]} if path in CHAT else {"prompt": prompt}
    out["stream"] = stream
    if path in OLLAMA:
        options = dict(sampling, **({} if max_tokens is None else {"num_predict": max_tokens}))
        return {**out, "options": options}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return {**out, **sampling, **({} if max_tokens is None else {"max_tokens": max_tokens})}


def encode(data: dict, raw: bytes = b"") -> bytes:
    return json.dumps(data).encode().replace(json.dumps(RAW).encode(), raw)


@dataclass(frozen=True)
class Reply:
    text: str
    tokens: int
    finish: str


@dataclass(frozen=True)
class GoodRequest:
    path: str
    stream: bool
    prompt: str
    max_tokens: int

    @property
    def name(self) -> str:
        return f"{self.path} {'stream' if self.stream else 'plain'} {self.max_tokens}: {self.prompt!r}"

    def payload(self) -> bytes:
        return encode(body(self.path, self.prompt, self.max_tokens, self.stream, temperature=0))


def good_pool(size: int) -> list[GoodRequest]:
    """`size` distinct greedy requests: every endpoint, streamed and not, prompts and max_tokens varied."""
    shapes = itertools.cycle(itertools.product(ENDPOINTS, (False, True)))
    return [GoodRequest(*next(shapes), PROMPTS[k % len(PROMPTS)], MAX_TOKENS[k % len(MAX_TOKENS)])
            for k in range(size)]


class Refused(Exception):
    """A good request answered with an error status, or a stream that carried an error or ended early."""

    def __init__(self, status: int | None, message: str):
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status


def send_good(client: httpx.Client, url: str, request: GoodRequest) -> Reply:
    headers = {"content-type": "application/json"}
    if not request.stream:
        r = client.post(url + request.path, content=request.payload(), headers=headers)
        if r.status_code != 200:
            raise Refused(r.status_code, r.text[:300])
        return _plain_reply(request.path, r.json())
    with client.stream("POST", url + request.path, content=request.payload(), headers=headers) as r:
        if r.status_code != 200:
            raise Refused(r.status_code, r.read().decode(errors="replace")[:300])
        return read_stream(request.path, r.iter_lines())


def read_stream(path: str, lines) -> Reply:
    """A streamed reply from its lines (SSE for OpenAI, JSON lines for Ollama); Refused when it carried an error or
    ended early."""
    return _ollama_stream(lines) if path in OLLAMA else _openai_stream(lines)


def _plain_reply(path: str, data: dict) -> Reply:
    if path in OLLAMA:
        text = data["message"]["content"] if path == "/api/chat" else data["response"]
        return Reply(text, data["eval_count"], data["done_reason"])
    choice = data["choices"][0]
    text = choice["message"]["content"] if path == "/v1/chat/completions" else choice["text"]
    return Reply(text, data["usage"]["completion_tokens"], choice["finish_reason"])


def _openai_stream(lines) -> Reply:
    text, tokens, finish, done = [], None, None, False
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:
            raise Refused(None, f"the stream carried an error: {chunk['error']}")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            text.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
            finish = choice["finish_reason"] or finish
    if not done or tokens is None:
        raise Refused(None, "the stream ended without its usage chunk and [DONE]")
    return Reply("".join(text), tokens, finish)


def _ollama_stream(lines) -> Reply:
    text = []
    for line in lines:
        if not line:
            continue
        part = json.loads(line)
        if "error" in part:
            raise Refused(None, f"the stream carried an error: {part['error']}")
        text.append(part.get("response") or part.get("message", {}).get("content") or "")
        if part["done"]:
            return Reply("".join(text), part["eval_count"], part["done_reason"])
    raise Refused(None, "the stream ended without its done line")


@dataclass(frozen=True)
class BadKind:
    name: str
    paths: tuple[str, ...]
    payload: Callable[[str], bytes]  # the raw body for a path


def _with(path: str, prompt="hi", max_tokens=4, raw: bytes = b"", **fields) -> bytes:
    return encode(body(path, prompt, max_tokens, **fields), raw)


def _without_prompt(path: str) -> bytes:
    data = body(path, "hi", 4)
    data.pop("messages" if path in CHAT else "prompt")
    return encode(data)


def bad_kinds(max_request_bytes: int, context: int) -> list[BadKind]:
    """Every kind must get a 4xx. `context` sizes a prompt and a max_tokens beyond it; `max_request_bytes` a body
    twice the server's limit."""
    oversized = "a" * (2 * max_request_bytes)
    return [
        BadKind("invalid JSON", ENDPOINTS, lambda p: b'{"prompt": "hi", "messages": ['),
        BadKind("JSON that is not an object", ENDPOINTS, lambda p: b"[1, 2, 3]"),
        BadKind("max_tokens of the wrong type", ENDPOINTS, lambda p: _with(p, max_tokens="many")),
        BadKind("temperature -1", ENDPOINTS, lambda p: _with(p, temperature=-1)),
        BadKind("top_p 0", ENDPOINTS, lambda p: _with(p, top_p=0)),
        BadKind("seed 2**70", ENDPOINTS, lambda p: _with(p, seed=2**70)),
        BadKind("n beyond the running and queued requests", ("/v1/chat/completions", "/v1/completions"),
                lambda p: _with(p, n=10**6)),
        BadKind("a field that would change the answer and is not honoured", ("/v1/chat/completions",),
                lambda p: _with(p, use_beam_search=True)),
        BadKind("token id outside the vocabulary", ("/v1/completions",), lambda p: _with(p, prompt=[1, 2, 10**6])),
        BadKind("prompt longer than the context", ENDPOINTS, lambda p: _with(p, prompt="hello " * (2 * context))),
        BadKind("max_tokens beyond the context", ENDPOINTS, lambda p: _with(p, max_tokens=2 * context)),
        BadKind("lone surrogate \\ud800", ENDPOINTS, lambda p: _with(p, prompt=RAW, raw=b'"\\ud800"')),
        BadKind("JSON nested 10000 deep", ENDPOINTS, lambda p: _with(p, prompt=RAW, raw=b"[" * 10000 + b"]" * 10000)),
        BadKind("a 5000-digit integer", ENDPOINTS, lambda p: _with(p, max_tokens=RAW, raw=b"7" * 5000)),
        BadKind("body over --max-request-bytes", ENDPOINTS, lambda p: _with(p, prompt=oversized)),
        BadKind("no messages / no prompt", ("/v1/chat/completions", "/v1/completions", "/api/chat"),
                _without_prompt),
        BadKind("unknown role", CHAT, lambda p: encode({**body(p, "hi", 4), "messages": [{"role": "wizard",
                                                                                           "content": "hi"}]})),
    ]


DISCONNECT = "client leaves mid-stream"


def send_bad(client: httpx.Client, url: str, path: str, payload: bytes) -> int:
    r = client.post(url + path, content=payload, headers={"content-type": "application/json"})
    return r.status_code


def leave_mid_stream(client: httpx.Client, url: str, path: str, after_lines: int = 2) -> None:
    """Start a long greedy stream, read `after_lines` lines of it and close the connection."""
    payload = encode(body(path, "Tell me a long story.", 512, stream=True, temperature=0))
    with client.stream("POST", url + path, content=payload, headers={"content-type": "application/json"}) as r:
        if r.status_code != 200:
            raise Refused(r.status_code, r.read().decode(errors="replace")[:300])
        lines = (line for line in r.iter_lines() if line)
        for _ in range(after_lines):
            next(lines)
