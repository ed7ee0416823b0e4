"""Between Anthropic's Messages API and the chat template: a conversation of content blocks in, content blocks out.

In: `system` first; an assistant turn's text, thinking (as `reasoning_content`, which templates like Qwen3's
show) and `tool_use` blocks (as `tool_calls`); a user turn's `tool_result` blocks as `tool` messages (each must
answer a `tool_use` of the assistant turn just before it), then its text. Consecutive turns of one role are
combined, as Anthropic's API combines them. A conversation that ends with an assistant turn is continued
(Anthropic's prefill): the reply goes on from that text.

Out: the reply split by the server's reasoning and tool-call parsers (tiermoe.server.output_parsers) into
`thinking`, `text` and `tool_use` blocks; a call whose arguments are not a JSON object stays in the text, so no
reply text ever vanishes. `stop_reason` from how the reply ended.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tiermoe.errors import TiermoeError
from tiermoe.server.anthropic_protocol import (
    Conversation,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from tiermoe.server.output_parsers import Split


@dataclass(frozen=True)
class Rendering:
    """What the chat template is given for a request."""

    messages: list[dict]
    tools: list[dict] | None  # OpenAI's function shape; None when there are none or tool_choice is "none"
    continue_final: bool  # the last message is the assistant's prefill
    template_kwargs: dict


def rendering(body: Conversation, template: str | None) -> Rendering:
    """The template's input for `body`; `template` is the chat template's source (to see which switches it has)."""
    messages: list[dict] = []
    system = body.system_text()
    if system:
        messages.append({"role": "system", "content": system})
    calls: dict[str, str] = {}  # tool_use id -> tool name, of the assistant turn just before
    for i, message in enumerate(body.messages):
        if message.role == "assistant":
            turn, calls = _assistant_turn(i, message)
        elif message.role == "user":
            turn, calls = _user_turn(i, message, calls), {}
        else:
            turn, calls = [{"role": "system", "content": _text_only(i, message)}], {}
        for part in turn:
            _append(messages, part)
    tools = None
    if body.tools and not (body.tool_choice is not None and body.tool_choice.type == "none"):
        tools = [t.for_template() for t in body.tools]
    kwargs = {}
    if body.thinking is not None and template is not None and "enable_thinking" in template:
        kwargs["enable_thinking"] = body.thinking.type != "disabled"
    return Rendering(messages, tools, body.messages[-1].role == "assistant", kwargs)


def _where(i: int, j: int | None = None) -> str:
    return f"messages.{i}.content" + (f".{j}" if j is not None else "")


def _assistant_turn(i: int, message: Message) -> tuple[list[dict], dict[str, str]]:
    text, thinking, calls = [], [], []
    for j, block in enumerate(message.blocks()):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append(block)
        elif isinstance(block, ToolResultBlock):
            raise TiermoeError(f"{_where(i, j)}: a tool_result block belongs in a user message (it answers the "
                               "assistant's tool_use)")
        # a redacted_thinking block is encrypted by Anthropic's servers: nothing for a local model to read
    turn: dict = {"role": "assistant", "content": "".join(text)}
    if calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.input}}
                              for c in calls]
    if thinking:
        turn["reasoning_content"] = "".join(thinking)
    return [turn], {c.id: c.name for c in calls}


def _user_turn(i: int, message: Message, calls: dict[str, str]) -> list[dict]:
    results, text = [], []
    for j, block in enumerate(message.blocks()):
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                said = f"({', '.join(calls)})" if calls else "(it made none)"
                raise TiermoeError(f"{_where(i, j)}: tool_result for tool_use_id {block.tool_use_id!r}, which is not "
                                   f"a tool_use of the assistant message just before {said}")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "name": calls[block.tool_use_id],
                            "content": block.text()})
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            raise TiermoeError(f"{_where(i, j)}: a {block.type} block belongs in an assistant message")
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _text_only(i: int, message: Message) -> str:
    blocks = message.blocks()
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise TiermoeError(f"{_where(i, j)}: a system message holds text blocks only")
    return "".join(b.text for b in blocks)


def _append(messages: list[dict], part: dict) -> None:
    """Consecutive text turns of one role become one turn, as Anthropic's API combines them."""
    last = messages[-1] if messages else None
    if (last is not None and last["role"] == part["role"] != "tool"
            and set(last) == set(part) == {"role", "content"}):
        last["content"] = f"{last['content']}\n\n{part['content']}" if last["content"] else part["content"]
        return
    messages.append(part)


def reply_blocks(split: Split, one_call: bool = False) -> tuple[list[dict], int]:
    """(content blocks of a finished reply, how many are tool_use). `one_call`: at most one tool_use
    (tool_choice's disable_parallel_tool_use)."""
    blocks: list[dict] = []
    if split.reasoning:
        blocks.append({"type": "thinking", "thinking": split.reasoning, "signature": ""})
    text = split.content
    uses = []
    for call in split.tool_calls:
        use = tool_use_block(call)
        if use is None or (one_call and uses):
            text += ("\n" if text else "") + f"{call['name']}({call['arguments']})"
        else:
            uses.append(use)
    if text:
        blocks.append({"type": "text", "text": text})
    return blocks + uses, len(uses)


def tool_use_block(call: dict) -> dict | None:
    """A parsed call as a tool_use block, or None when its arguments are not a JSON object."""
    try:
        arguments = json.loads(call["arguments"]) if call["arguments"].strip() else {}
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call["name"], "input": arguments}


def stop_reason(finish_reason: str, stop_string: str | None, used_tools: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for an engine finish_reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if used_tools:
        return "tool_use", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None
