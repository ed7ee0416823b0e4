"""Reasoning and tool-call parsing of a chat reply (SGLang's --reasoning-parser and --tool-call-parser).

A reply's text is split into `reasoning_content` (the model's thinking), `content` (the answer) and `tool_calls`,
in the formats the models emit:

| reasoning parser | reasoning |
|---|---|
| qwen3, deepseek-v3, glm45 | `<think>...</think>` when the reply opens with it |
| deepseek-r1 | everything up to `</think>` (its template opens the think block) |
| gpt-oss | harmony's `analysis` channel (tiermoe.server.harmony_stream, which also reads its calls) |

The tool-call formats are in tiermoe.server.tool_call_formats. No reply text vanishes: what the parsers cannot read
(a malformed or cut-off call, a marker mentioned in prose, text after the calls) stays in `content`, verbatim.

`StreamSplitter` splits a reply as it streams: each piece of text is scanned once (with a held tail shorter than
a marker), so a step's work does not grow with the reply. Text that could be the start of a marker is held back
until it is known, and from a tool call's first marker on, text is held until the reply ends, when its calls are
parsed and sent whole (the openai client gathers deltas the same way). `OutputParser.split` is the same splitter fed
the whole reply at once, so a stream and a whole reply split alike.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from tiermoe.server import tool_call_formats
from tiermoe.server.harmony_stream import HARMONY_MARKERS, HarmonySplitter
from tiermoe.server.marker_scan import MarkerScanner

REASONING_PARSERS = ("qwen3", "deepseek-r1", "deepseek-v3", "glm45", "gpt-oss")
TOOL_CALL_PARSERS = ("qwen25", "qwen", "qwen3", "deepseekv3", "deepseekv31", "glm45", "gpt-oss")
THINK, END_THINK = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments" (a JSON string)}


class OutputParser:
    """Splits one reply by the server's reasoning and tool-call parsers (either may be None)."""

    def __init__(self, reasoning: str | None, tools: str | None):
        self.reasoning, self.tools = reasoning, tools

    @property
    def harmony(self) -> bool:
        return "gpt-oss" in (self.reasoning, self.tools)

    @property
    def markers(self) -> tuple[str, ...]:
        """The markers this parser reads, which the reply's text must keep (tokenizers often mark them special)."""
        if self.harmony:
            return HARMONY_MARKERS
        return (*((THINK, END_THINK) if self.reasoning else ()), *tool_call_formats.MARKERS.get(self.tools, ()))

    def split(self, text: str, final: bool) -> Split:
        """The reply `text` split (`final`: it is the whole reply; else what could still change is held back)."""
        splitter = StreamSplitter(self)
        reasoning, content, calls = splitter.feed(text, final)
        return Split(reasoning, content, calls)


def tool_call_objects(calls: list[dict], streamed: bool = False) -> list[dict]:
    """OpenAI's `tool_calls` entries (with `index` in a stream's delta)."""
    return [{**({"index": i} if streamed else {}), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for i, c in enumerate(calls)]


def keeping_markers(tokenizer, markers) -> callable:
    """A detokenizer that drops special tokens but `markers` (the ones the server's parsers read: tokenizers often
    mark them special, GPT-OSS's harmony markers and many think and tool-call markers, and the engine's own
    detokenizer skips special tokens)."""
    vocab = tokenizer.get_vocab()
    keep = {vocab[m] for m in markers if m in vocab}
    drop = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}

    def detokenize(ids):
        return tokenizer.decode([i for i in ids if i in keep or i not in drop], skip_special_tokens=False)

    return detokenize


class StreamSplitter:
    """A stream's deltas: feed each new piece of the reply (the first after `prefix`, the reply's opening that the
    prompt holds); get the reasoning and content not yet sent, and at the end (`final`) the tool calls."""

    def __init__(self, parser: OutputParser, prefix: str = ""):
        self.parser, self.prefix = parser, prefix
        if parser.harmony:
            self.harmony = HarmonySplitter(parser.reasoning == "gpt-oss", parser.tools == "gpt-oss")
            return
        self.harmony = None
        self.state = "opening" if parser.reasoning is not None else "answer"
        self.lead, self.seen = "", ""  # the reply's leading whitespace, and what follows while a think block may open
        self.spaces = ""  # answer whitespace held while a tool call may follow it
        self.call_start = tool_call_formats.START.get(parser.tools)
        self.think_end = MarkerScanner((END_THINK,))
        self.answer = MarkerScanner((self.call_start,)) if self.call_start else None
        self.calls_text: list[str] = []

    def feed(self, piece: str, final: bool) -> tuple[str, str, list[dict]]:
        piece, self.prefix = self.prefix + piece, ""
        out = Split()
        if self.harmony is not None:
            self.harmony.feed(piece, final, out)
            return out.reasoning, out.content, self.harmony.calls if final else []
        while piece is not None:
            piece = getattr(self, "_" + self.state)(piece, final, out)
        if final and self.calls_text:
            out.tool_calls, leftover = tool_call_formats.parse_calls(self.parser.tools, "".join(self.calls_text))
            if leftover:  # what no call could be read from stays in the answer, with the whitespace before it
                out.content += self.spaces + leftover
        return out.reasoning, out.content, out.tool_calls

    def _opening(self, piece, final, out):
        """Whether the reply opens a think block is known once its first characters past whitespace are."""
        if not self.seen:
            stripped = piece.lstrip()
            self.lead += piece[:len(piece) - len(stripped)]
            piece = stripped
        self.seen += piece
        if not final and THINK.startswith(self.seen):
            return None
        if self.seen.startswith(THINK):
            self.state = "thinking"
            return self.seen[len(THINK):]
        self.state = "thinking" if self.parser.reasoning == "deepseek-r1" else "answer"  # its template opens it
        return self.lead + self.seen

    def _thinking(self, piece, final, out):
        before, marker, after = self.think_end.feed(piece, final)
        out.reasoning += before
        if marker is None:
            return None
        self.state = "after_think"
        return after

    def _after_think(self, piece, final, out):
        """The newlines that follow `</think>` belong to neither part."""
        piece = piece.lstrip("\n")
        if not piece:
            return None
        self.state = "answer"
        return piece

    def _answer(self, piece, final, out):
        if self.answer is None:
            out.content += piece
            return None
        before, marker, after = self.answer.feed(piece, final)
        if marker is not None:
            lead = self.spaces + before
            out.content += lead.rstrip()  # the whitespace that led up to the calls is held: it goes with them
            self.spaces, self.state, self.calls_text = lead[len(lead.rstrip()):], "calls", [marker]
            return after
        if final:
            out.content += self.spaces + before
            return None
        stripped = before.rstrip()
        if stripped:
            out.content += self.spaces + stripped
            self.spaces = before[len(stripped):]
        else:
            self.spaces += before
        return None

    def _calls(self, piece, final, out):
        """From the first call's marker on, the text is parsed once, when the reply ends (the None return, as
        every state's, says the piece is consumed)."""
        self.calls_text.append(piece)
