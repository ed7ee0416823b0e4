"""What the Ollama endpoints put on their lines: `response` for /api/generate, `message` for /api/chat. With `tools`
in a chat request and the server's --tool-call-parser, the model's calls come back as Ollama does it,
`message.tool_calls` = [{"function": {"name", "arguments": {...}}}] (arguments an object, not a JSON string), on a
line of their own before the last one in a stream; a call whose arguments are not a JSON object is dropped.
"""

from __future__ import annotations

import json

from tiermoe.server.output_parsers import OutputParser, StreamSplitter


class GenerateReply:
    def whole(self, text: str) -> dict:
        return {"response": text}

    def delta(self, text: str, final: bool) -> dict | None:
        """The line's fields for a stream's new `text`, None when there is nothing to send yet."""
        return {"response": text} if text else None

    def empty(self) -> dict:
        return {"response": ""}


class ChatReply:
    def __init__(self, parser: OutputParser | None):
        self.parser = parser
        self.splitter = StreamSplitter(parser) if parser is not None else None

    def whole(self, text: str) -> dict:
        if self.parser is None:
            return _message(text)
        split = self.parser.split(text, final=True)
        return _message(split.content, ollama_tool_calls(split.tool_calls))

    def delta(self, text: str, final: bool) -> dict | None:
        if self.splitter is None:
            return _message(text) if text else None
        _, content, calls = self.splitter.feed(text, final)
        calls = ollama_tool_calls(calls)
        return _message(content, calls) if content or calls else None

    def empty(self) -> dict:
        return _message("")


def _message(content: str, tool_calls: list[dict] | None = None) -> dict:
    return {"message": {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}}


def ollama_tool_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls ({"name", "arguments" as JSON text}) in Ollama's shape."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call["arguments"])
        except ValueError:
            continue
        if isinstance(arguments, dict):
            out.append({"function": {"name": call["name"], "arguments": arguments}})
    return out
