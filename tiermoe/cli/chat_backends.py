"""Where `tiermoe chat` gets its replies: a running server (as `kt chat` does; this module), or a model loaded in this
process (`--local`: tiermoe.cli.chat_local, imported only then, since it loads torch). Both yield the reply's text
deltas, a server's reasoning deltas tagged so the loop can set them apart, and keep the last reply's speed in `stats`.

This module needs only httpx: a chat with a server starts in a fraction of a second."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tiermoe.cli.api_key import API_KEY_VARIABLE
from tiermoe.errors import TiermoeError


@dataclass(frozen=True)
class Delta:
    text: str
    reasoning: bool = False  # a reasoning model's thinking (`reasoning_content`), not part of the answer


@dataclass(frozen=True)
class ReplyStats:
    """One reply's speed, as --verbose prints it (tiermoe.cli.speed_line)."""

    prompt_tokens: int
    ttft_s: float  # from sending the conversation to the first token
    decode_tokens: int  # tokens after the first
    decode_s: float  # from the first token to the last


def base_url(args) -> str:
    """--url when given, else http://HOST:PORT from -H/-p (kt chat's defaults 127.0.0.1:30000)."""
    if args.url:
        return args.url.rstrip("/")
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


class RemoteChat:
    """A server's /v1/chat/completions, the model chosen as `kt chat` does: -m if the server serves it, else (with a
    warning) the first model /v1/models lists."""

    stops_between_tokens = False  # Ctrl-C interrupts at once: leaving the stream closes the request (server aborts)

    def __init__(self, args):
        self.url = base_url(args)
        key = args.api_key or os.environ.get(API_KEY_VARIABLE)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # kt chat asks whether to keep HTTP(S)_PROXY and defaults to no; a proxy never reaches this machine's server
        loopback = httpx.URL(self.url).host in ("127.0.0.1", "localhost", "::1")
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=None, trust_env=not loopback)
        self.args = args
        self.model = args.model or "default"
        self.stats: ReplyStats | None = None

    def connect(self) -> str:
        """Checks the server answers and picks the model; a missing server is one line that says what to do."""
        try:
            response = self.client.get("/v1/models", timeout=10)
        except httpx.HTTPError as err:
            local = f" {self.args.model}" if self.args.model and Path(self.args.model).is_dir() else ""
            raise TiermoeError(f"no server at {self.url} ({type(err).__name__}): start one with `tiermoe serve`, or "
                               f"chat with a model loaded here: `tiermoe chat --local{local}`") from None
        served = [m.get("id") for m in _json(response, self.url).get("data", []) if m.get("id")]
        if not served:
            raise TiermoeError(f"the server at {self.url} lists no model in /v1/models")
        if self.args.model and self.args.model not in served:
            print(f"warning: model '{self.args.model}' is not served at {self.url} (it serves {', '.join(served)}); "
                  f"using {served[0]}", file=sys.stderr)
        self.model = self.args.model if self.args.model in served else served[0]
        return self.model

    def reply(self, messages: list[dict], stop: threading.Event | None = None):
        """Text deltas of the reply to `messages`; `stop` is not read (Ctrl-C interrupts a server's reply at once).
        A streamed reply that ends leaves its speed in `self.stats`: the server's token counts (the stream's usage
        chunk) over the times seen here."""
        body = {"model": self.model, "messages": messages, "stream": self.args.stream,
                "max_tokens": self.args.max_tokens, "temperature": self.args.temperature}
        self.stats = None
        try:
            if not self.args.stream:
                message = _json(self.client.post("/v1/chat/completions", json=body), self.url)["choices"][0]["message"]
                yield from _message_deltas(message)
                return
            body["stream_options"] = {"include_usage": True}
            yield from self._stream(body)
        except httpx.HTTPError as err:
            raise TiermoeError(f"lost the server at {self.url}: {err}") from None

    def _stream(self, body: dict):
        sent, first, last, usage = time.monotonic(), None, None, None
        with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                _json(response, self.url)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    raise TiermoeError(f"the server failed mid-reply: {chunk['error'].get('message')}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    for delta in _message_deltas(choice.get("delta", {})):
                        last = time.monotonic()
                        first = first or last
                        yield delta
        if first is not None and usage and usage.get("completion_tokens"):
            self.stats = ReplyStats(usage.get("prompt_tokens", 0), first - sent, usage["completion_tokens"] - 1,
                                    last - first)

    def describe(self) -> str:
        return f"{self.model} at {self.url}"

    def close(self):
        self.client.close()


def _message_deltas(message: dict):
    if message.get("reasoning_content"):
        yield Delta(message["reasoning_content"], reasoning=True)
    if message.get("content"):
        yield Delta(message["content"])


def _json(response: httpx.Response, url: str) -> dict:
    if response.status_code != 200:
        raise TiermoeError(f"the server at {url} answered {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError:
        raise TiermoeError(f"the server at {url} did not answer JSON: {response.text[:100]!r}") from None
