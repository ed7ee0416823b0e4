"""Tool calls in the formats models write them (SGLang's --tool-call-parser names), read from the tool-call part
of a finished reply: the text from the first call's opening marker to the reply's end.

| parser | a call |
|---|---|
| qwen25 / qwen / qwen3 | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` |
| deepseekv3 (V3, R1) | `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a ```json block + `<｜tool▁call▁end｜>` |
| deepseekv31 (V3.1, V3.2) | `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` |
| glm45 | `<tool_call>NAME` (a newline or not) + `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs + `</tool_call>` |

DeepSeek's calls sit inside `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`; both DeepSeek parsers read both call
forms. No reply text vanishes: a call that does not parse (invalid JSON, cut off by max_tokens, a marker mentioned
in prose) and any text between or after the calls come back verbatim as `leftover`, which the reply's content keeps.
"""

from __future__ import annotations

import json
import re

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
QWEN_MARKERS = ("<tool_call>", "</tool_call>")
GLM_MARKERS = (*QWEN_MARKERS, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
DS_MARKERS = (DS_CALLS, DS_CALL, DS_SEP, DS_CALL_END, DS_CALLS_END)
MARKERS = {"qwen25": QWEN_MARKERS, "qwen": QWEN_MARKERS, "qwen3": QWEN_MARKERS, "glm45": GLM_MARKERS,
           "deepseekv3": DS_MARKERS, "deepseekv31": DS_MARKERS}
START = {name: markers[0] for name, markers in MARKERS.items()}  # what opens a reply's tool-call part

TAGGED_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
DS_BLOCK = re.compile(re.escape(DS_CALL) + r"(.*?)" + re.escape(DS_SEP) + r"(.*?)(" + re.escape(DS_CALL_END)
                      + r"|\Z)", re.DOTALL)
GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)
FENCED_JSON = re.compile(r"\s*```(?:json)?\s*\n(.*?)\n?```\s*\Z", re.DOTALL)


def call(name: str, arguments) -> dict:
    """A parsed call: {"name", "arguments" (a JSON string)}."""
    return {"name": name.strip(), "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}


def parse_calls(kind: str, text: str) -> tuple[list[dict], str]:
    """The calls in `text` (a finished reply's tool-call part) and the text that is not a call the parser could
    read, verbatim."""
    if kind in ("deepseekv3", "deepseekv31"):
        calls, rest = _blocks(text.removeprefix(DS_CALLS), DS_BLOCK, _deepseek_call)
        rest = rest.replace(DS_CALLS_END, "", 1) if calls else text  # the markers that framed the calls read
    else:
        calls, rest = _blocks(text, TAGGED_BLOCK, _glm_call if kind == "glm45" else _qwen_call)
    return calls, rest if rest.strip() else ""


def _blocks(text: str, pattern: re.Pattern, read) -> tuple[list[dict], str]:
    """Each match of `pattern` read by `read(match)` (a call, or None); unread matches and the text around the
    matches are the leftover."""
    calls, leftover, at = [], [], 0
    for match in pattern.finditer(text):
        leftover.append(text[at:match.start()])
        parsed = read(match)
        if parsed is None:
            leftover.append(match.group(0))
        else:
            calls.append(parsed)
        at = match.end()
    leftover.append(text[at:])
    return calls, "".join(leftover)


def json_object(text: str) -> dict | None:
    """`text` as a JSON object, or None (not JSON, or JSON of another kind)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _qwen_call(match: re.Match) -> dict | None:
    """{"name", "arguments"} JSON; unclosed only when the JSON is whole (a model that stopped at the call's end)."""
    data = json_object(match.group(1).strip())
    if data is None or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str) and json_object(arguments) is None:
        return None
    return call(data["name"], arguments)


def _glm_call(match: re.Match) -> dict | None:
    """NAME then key/value pairs, closed by `</tool_call>` (else it was cut off: its pairs may be missing)."""
    if not match.group(2):
        return None
    body = match.group(1)
    name, _, _ = body.partition("<arg_key>")
    pairs_text = body[len(name):]
    pairs = GLM_PAIR.findall(pairs_text)
    if not name.strip() or "\n" in name.strip() or GLM_PAIR.sub("", pairs_text).strip():
        return None
    return call(name, {k.strip(): _json_or_text(v) for k, v in pairs})


def _deepseek_call(match: re.Match) -> dict | None:
    """V3: `function<｜tool▁sep｜>NAME` + fenced JSON; V3.1: `NAME<｜tool▁sep｜>` + bare JSON; closed by the call's
    end marker, or unclosed with whole JSON."""
    head, body, closed = match.groups()
    if head.strip() == "function":
        name, _, fenced = body.partition("\n")
        fence = FENCED_JSON.match(fenced)
        arguments = json_object(fence.group(1)) if fence else None
    else:
        name, arguments = head, json_object(body.strip())
    if arguments is None or not name.strip() or (not closed and head.strip() == "function" and fence is None):
        return None
    return call(name, arguments)


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value
