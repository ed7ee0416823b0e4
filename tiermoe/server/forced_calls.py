"""Forcing a tool call (`tool_choice` "required" or a named function) without a grammar engine: the assistant's turn
is begun inside a call of the --tool-call-parser format, so the model can only go on with the call, and the reply is
parsed with that opening put back in front of it.

| parser | "required" opens with | a named function X opens with |
|---|---|---|
| qwen25 / qwen / qwen3 | `<tool_call>\\n` | `<tool_call>\\n{"name": "X", "arguments": ` |
| glm45 | `<tool_call>` | `<tool_call>X\\n` |
| deepseekv3 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>` | ... + `function<｜tool▁sep｜>X\\n```json\\n` |
| deepseekv31 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>` | ... + `X<｜tool▁sep｜>` |
| gpt-oss | `<|channel|>commentary to=functions.` | `<|channel|>commentary to=functions.X` |

A template that opens a think block in its generation prompt (DeepSeek-R1's, Qwen3's thinking ones) gets it closed
first (`</think>` and a blank line): a call inside the block would be read as thinking. Nothing holds the model to
valid arguments beyond the opening: a call it leaves malformed stays in the reply's content, as any other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tiermoe.errors import TiermoeError
from tiermoe.server.output_parsers import END_THINK, THINK
from tiermoe.server.tool_call_formats import DS_CALL, DS_CALLS, DS_SEP

HARMONY_CALL = "<|channel|>commentary to=functions."


@dataclass(frozen=True)
class ForcedCall:
    prompt_suffix: str  # appended to the rendered prompt
    reply_prefix: str  # put in front of the reply before it is parsed


def call_opening(parser: str, name: str | None) -> str:
    """The text that begins a call in the `parser`'s format (of the function `name` when given)."""
    if parser in ("qwen25", "qwen", "qwen3"):
        return "<tool_call>\n" + (f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ' if name else "")
    if parser == "glm45":
        return "<tool_call>" + (f"{name}\n" if name else "")
    if parser == "deepseekv3":
        return DS_CALLS + DS_CALL + (f"function{DS_SEP}{name}\n```json\n" if name else "")
    if parser == "deepseekv31":
        return DS_CALLS + DS_CALL + (f"{name}{DS_SEP}" if name else "")
    if parser == "gpt-oss":
        return HARMONY_CALL + (name or "")
    raise TiermoeError(f"forcing a tool call is not implemented for --tool-call-parser {parser}")


def forced_call(tool_choice, tool_parser: str | None, reasoning_parser: str | None,
                prompt_tail: str) -> ForcedCall | None:
    """How to force the call `tool_choice` asks for (None when it asks for none); `prompt_tail` is the end of the
    rendered prompt's text, to see whether the template left a think block open."""
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    if name is None and tool_choice != "required":
        return None
    if tool_parser is None:
        raise TiermoeError(f"tool_choice {json.dumps(tool_choice)} forces a tool call, which needs the server "
                           "started with --tool-call-parser (the format the model writes calls in)")
    opening = call_opening(tool_parser, name)
    think_open = tool_parser != "gpt-oss" and prompt_tail.rstrip().endswith(THINK)
    close = f"{END_THINK}\n\n" if think_open else ""
    # DeepSeek-R1's parser reads everything up to </think> as thinking, whether or not the prompt opened it
    return ForcedCall(close + opening, (END_THINK if reasoning_parser == "deepseek-r1" else "") + opening)


def reply_start(tool_choice, tool_parser: str | None, reasoning_parser: str | None,
                prompt_tail: str) -> ForcedCall | None:
    """How the reply begins, beyond what the model writes: a forced call (forced_call), or, for a think-block
    reasoning parser, `<think>` when the template opened the block in the prompt (Qwen3's thinking templates,
    DeepSeek-R1's): the reply starts inside the block, and is parsed with its opening put back in front."""
    forced = forced_call(tool_choice, tool_parser, reasoning_parser, prompt_tail)
    if forced is not None or reasoning_parser in (None, "gpt-oss", "deepseek-r1"):
        return forced  # (DeepSeek-R1's parser reads everything up to </think> as thinking already)
    return ForcedCall("", THINK) if prompt_tail.rstrip().endswith(THINK) else None
