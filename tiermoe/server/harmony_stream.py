"""GPT-OSS's harmony format split as it streams: reasoning, answer and tool calls.

A reply is a run of messages, `ROLE-HEADER<|channel|>CHANNEL-HEADER<|message|>BODY<|end|>` (or `<|call|>`,
`<|return|>`), the next one opened by `<|start|>`. The first message's header begins in the prompt (which ends with
`<|start|>assistant`), so the reply opens inside a header. Where a body goes is read from its whole header: a
recipient `to=functions.NAME` (in the role header or the channel header) makes the body a tool call's arguments,
the `analysis` channel is reasoning, anything else (`final`, a `commentary` preamble) is the answer. What the
server's parsers do not claim stays in the answer, and so does a call whose arguments are not a JSON object
(cut off, or malformed), verbatim: no reply text vanishes, markers aside.
"""

from __future__ import annotations

import re

from tiermoe.server.marker_scan import MarkerScanner
from tiermoe.server.tool_call_formats import call, json_object

MESSAGE, START, CHANNEL = "<|message|>", "<|start|>", "<|channel|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
HARMONY_MARKERS = (MESSAGE, START, CHANNEL, "<|constrain|>", *BODY_ENDS[:3])
RECIPIENT = re.compile(r"to=functions\.([\w.-]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"(\w+)")


class HarmonySplitter:
    def __init__(self, reasoning: bool, tools: bool):
        self.reasoning, self.tools = reasoning, tools
        self.state, self.header, self.scanner = "header", [], MarkerScanner((MESSAGE,))
        self.target, self.call_name, self.call_header, self.call_body = "content", "", "", []
        self.calls: list[dict] = []

    def feed(self, piece: str, final: bool, out) -> None:
        """Adds what `piece` holds to `out` (its reasoning and content; calls as they complete)."""
        while piece is not None:
            piece = getattr(self, "_" + self.state)(piece, final, out)

    def _header(self, piece, final, out):
        before, marker, after = self.scanner.feed(piece, final)
        self.header.append(before)
        if marker is None:
            if final:  # a header never closed: not harmony after all, or cut off; its text is the answer's
                out.content += "".join(self.header)
            return None
        header, self.header = "".join(self.header), []
        recipient, channel = RECIPIENT.search(header), CHANNEL_NAME.search(header)
        if recipient and self.tools:
            self.target, self.call_name, self.call_header, self.call_body = "call", recipient.group(1), header, []
        elif channel and channel.group(1) == "analysis" and self.reasoning:
            self.target = "reasoning"
        else:
            self.target = "content"
        self.state, self.scanner = "body", MarkerScanner(BODY_ENDS)
        return after

    def _body(self, piece, final, out):
        before, marker, after = self.scanner.feed(piece, final)
        if self.target == "call":
            self.call_body.append(before)
        elif self.target == "reasoning":
            out.reasoning += before
        else:
            out.content += before
        if marker is None and not final:
            return None
        if self.target == "call":  # ended, or cut off by the end of the reply
            body = "".join(self.call_body)
            if json_object(body.strip()) is not None:
                self.calls.append(call(self.call_name, body.strip()))
            else:  # arguments that are not a JSON object: the message stays in the answer as it was written
                out.content += self.call_header + MESSAGE + body
        if marker == START:
            self.state, self.scanner = "header", MarkerScanner((MESSAGE,))
        elif marker is not None:
            self.state, self.scanner = "between", MarkerScanner((START, CHANNEL))
        return after if marker is not None else None

    def _between(self, piece, final, out):
        """After a message's end: the next message starts at `<|start|>` (or a bare `<|channel|>`)."""
        before, marker, after = self.scanner.feed(piece, final)
        out.content += before
        if marker is None:
            return None
        self.state, self.scanner = "header", MarkerScanner((MESSAGE,))
        self.header = [marker] if marker == CHANNEL else []
        return after
