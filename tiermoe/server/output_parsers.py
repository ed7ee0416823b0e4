"""Reasoning and tool-call parsing of a chat reply (SGLang's --reasoning-parser and --tool-call-parser).

A reply's text is split into `reasoning_content` (the model's thinking), `content` (the answer) and `tool_calls`,
in the formats the models emit:

| parser | reasoning | tool calls |
|---|---|---|
| qwen3 / qwen25 (qwen) | `<think>...</think>` when the reply opens with it | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` |
| deepseek-r1 | everything up to `</think>` (its template opens the think block) | - |
| deepseek-v3 / deepseekv3 | `<think>...</think>` when opened | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a ```json block |
| glm45 | `<think>...</think>` when opened | `<tool_call>NAME` + `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs |
| gpt-oss | harmony's `analysis` channel | harmony's `commentary to=functions.NAME` messages; the answer is the `final` channel |

`split(text, final)` parses the text so far. A stream re-parses at each step and sends what grew: text that could
be the start of a marker is held back until it is known, and from a tool call's first marker on, text is held
until the reply ends, when its calls are sent whole (the openai client gathers deltas the same way).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

REASONING_PARSERS = ("qwen3", "deepseek-r1", "deepseek-v3", "glm45", "gpt-oss")
TOOL_CALL_PARSERS = ("qwen25", "qwen", "qwen3", "deepseekv3", "glm45", "gpt-oss")
THINK, END_THINK = "<think>", "</think>"
DS_CALLS, DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", \
    "<｜tool▁call▁end｜>"
TOOL_CALL_START = {"qwen25": "<tool_call>", "qwen": "<tool_call>", "qwen3": "<tool_call>", "glm45": "<tool_call>",
                   "deepseekv3": DS_CALLS}
HARMONY = re.compile(r"<\|channel\|>(\w+)([^<]*)(?:<\|constrain\|>\w+)?<\|message\|>(.*?)"
                     r"(?=<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>|$)", re.S)
HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|start|>", "<|constrain|>", "<|return|>")


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments" (a JSON string)}


def _held(text: str, markers) -> str:
    """`text` less a tail that could be the start of one of `markers` (so no marker is ever sent in pieces)."""
    for cut in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-cut:]) for m in markers):
            return text[:-cut]
    return text


def _call(name: str, arguments) -> dict:
    return {"name": name.strip(), "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}


def _tool_calls(kind: str, text: str) -> list[dict]:
    """The calls in the tool-call part of a finished reply (what follows the first start marker)."""
    calls = []
    if kind in ("qwen25", "qwen", "qwen3"):
        for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S):
            try:
                data = json.loads(block.strip())
                calls.append(_call(data["name"], data.get("arguments", data.get("parameters", {}))))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    elif kind == "deepseekv3":
        pattern = re.escape(DS_CALL) + r"(?:function)?" + re.escape(DS_SEP) + r"(.*?)\n```(?:json)?\n(.*?)\n```"
        calls = [_call(name, args.strip()) for name, args in re.findall(pattern, text, re.S)]
    elif kind == "glm45":
        for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S):
            name, _, rest = block.partition("\n") if "<arg_key>" in block else (block, "", "")
            pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", rest, re.S)
            calls.append(_call(name, {k.strip(): _json_or_text(v) for k, v in pairs}))
    return calls


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


class OutputParser:
    """Splits one reply by the server's reasoning and tool-call parsers (either may be None)."""

    def __init__(self, reasoning: str | None, tools: str | None):
        self.reasoning, self.tools = reasoning, tools

    @property
    def harmony(self) -> bool:
        return "gpt-oss" in (self.reasoning, self.tools)

    def split(self, text: str, final: bool) -> Split:
        if self.harmony:
            return self._split_harmony(text, final)
        out = Split()
        rest = text
        if self.reasoning is not None:
            if not final and THINK.startswith(rest.lstrip()):
                return out  # the reply may yet open a think block: wait until it is known
            opened = rest.lstrip().startswith(THINK)
            if opened or self.reasoning == "deepseek-r1":
                body = rest.lstrip()[len(THINK):] if opened else rest
                thought, ended, rest = body.partition(END_THINK)
                out.reasoning = thought if ended or final else _held(thought, (END_THINK,))
                if not ended:
                    return out
                rest = rest.lstrip("\n")
        start = TOOL_CALL_START.get(self.tools)
        if start is not None and start in rest:
            before, _, calls = rest.partition(start)
            out.content = before.rstrip()  # the whitespace that led up to the calls
            out.tool_calls = _tool_calls(self.tools, start + calls) if final else []
            return out
        # whitespace is held too while a tool call may follow it
        out.content = rest if final or start is None else _held(rest, (start,)).rstrip()
        return out

    def _split_harmony(self, text: str, final: bool) -> Split:
        out = Split()
        if "<|channel|>" not in text:
            out.content = text if final else _held(text, HARMONY_MARKERS)
            return out
        for match in HARMONY.finditer(text):
            channel, header, body = match.groups()
            complete = final or match.end() < len(text)
            body = body if complete else _held(body, HARMONY_MARKERS)
            target = re.search(r"to=functions\.([\w.-]+)", header)
            if target and self.tools == "gpt-oss":
                if complete:
                    out.tool_calls.append(_call(target.group(1), body.strip()))
            elif channel == "analysis" and self.reasoning == "gpt-oss":
                out.reasoning += body
            elif channel == "final" or channel not in ("analysis", "commentary"):
                out.content += body
        return out


def tool_call_objects(calls: list[dict], streamed: bool = False) -> list[dict]:
    """OpenAI's `tool_calls` entries (with `index` in a stream's delta)."""
    return [{**({"index": i} if streamed else {}), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for i, c in enumerate(calls)]


def keeping_markers(tokenizer, markers) -> callable:
    """A detokenizer that drops special tokens but `markers` (GPT-OSS's harmony markers are special tokens, which
    the engine's own detokenizer skips)."""
    vocab = tokenizer.get_vocab()
    keep = {vocab[m] for m in markers if m in vocab}
    drop = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}

    def detokenize(ids):
        return tokenizer.decode([i for i in ids if i in keep or i not in drop], skip_special_tokens=False)

    return detokenize


class StreamSplitter:
    """A stream's deltas: feed the text so far, get the reasoning and content not yet sent; the calls at the end."""

    def __init__(self, parser: OutputParser):
        self.parser, self.sent = parser, Split()

    def feed(self, text: str, final: bool) -> tuple[str, str, list[dict]]:
        now = self.parser.split(text, final)
        reasoning = now.reasoning[len(self.sent.reasoning):] if now.reasoning.startswith(self.sent.reasoning) else ""
        content = now.content[len(self.sent.content):] if now.content.startswith(self.sent.content) else ""
        self.sent = Split(self.sent.reasoning + reasoning, self.sent.content + content)
        return reasoning, content, now.tool_calls if final else []
