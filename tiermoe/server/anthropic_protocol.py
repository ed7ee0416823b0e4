"""Request bodies of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), validated by pydantic.

Unlike the OpenAI routes, which ignore names they do not know (as vLLM and SGLang do), this API is checked
strictly, as Anthropic's own server checks it: a field outside the documented API, or a content block or tool
type a text model cannot take (an image, a server tool), is a 400 naming it. Every documented field is
accepted: honoured (see docs/server-api.md, "Anthropic Messages API"), or, when it has no meaning for a local
model (prompt caching, service tiers, containers, workspaces, ...), accepted and listed there as such. A field
that would change the answer but is not implemented here (`output_config.format`, `strict` tools) is accepted
only at its neutral value, a 400 otherwise, as on the other routes (tiermoe.server.unsupported).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from tiermoe.server.protocol import MAX_COUNT
from tiermoe.server.unsupported import only


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None  # no prompt cache to mark (prefix reuse is automatic)
    citations: list[dict] | None = None  # where a text came from: nothing to do with it locally


class ThinkingBlock(_Strict):
    """An earlier assistant turn's thinking, handed back: given to the chat template as `reasoning_content`."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str  # encrypted by Anthropic's servers: nothing a local model can read; left out of the prompt


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict | None = None  # which of Anthropic's callers made the call: always this model here
    toolset_name: str | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


Block = Annotated[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
                  Field(discriminator="type")]
BLOCK_TYPES = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")
_BLOCK = TypeAdapter(Block)


def _known_blocks(value):
    """Blocks checked here, so that the error names the block and its field (a `str | list` union would report
    that the content is not a string), and a block type a text model cannot take (image, document,
    search_result, server tool results...) is named."""
    if not isinstance(value, list):
        return value
    for j, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in BLOCK_TYPES:
            raise ValueError(f"a content block of type {str(kind)[:40]!r} is not supported by this server (its "
                             f"models read text: {', '.join(BLOCK_TYPES)})")
        try:
            _BLOCK.validate_python(block)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"][1:])  # past the discriminator's tag
            raise ValueError(f"block {j} ({kind}): {where + ': ' if where else ''}{first['msg']}") from None
    return value


class Message(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    _blocks = field_validator("content", mode="before")(classmethod(lambda cls, value: _known_blocks(value)))

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class Tool(_Strict):
    """A client tool. Anthropic's server tools (web search, code execution, bash, ...) run on its servers: a 400."""

    name: str = Field(min_length=1, max_length=128)
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None  # tool search is Anthropic's server feature: every tool is shown
    eager_input_streaming: bool | None = None  # a call's input is streamed whole once parsed
    input_examples: list[dict] | None = None
    strict: Annotated[bool | None, only(None, False)] = None  # guaranteed schemas need a grammar engine

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value):
        if value.get("type") != "object":
            raise ValueError("input_schema must be a JSON schema of type 'object'")
        return value

    def for_template(self) -> dict:
        """The tool as chat templates take tools (OpenAI's function shape)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description or "",
                                                 "parameters": self.input_schema}}


def _client_tools(value):
    for tool in value if isinstance(value, list) else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"the tool type {str(kind)[:60]!r} is one of Anthropic's server tools, which run on "
                             "its servers; this server takes client tools ({\"name\", \"input_schema\"})")
    return value


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False  # honoured: at most one tool_use block in the reply

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice {"type": "tool"} takes a "name", and only it')
        return self


class Thinking(_Strict):
    """Mapped to the chat template's reasoning switch (`enable_thinking`) where it has one."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1024, le=MAX_COUNT)  # bounded by max_tokens alone here
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError('thinking {"type": "enabled"} needs budget_tokens (at least 1024)')
        return self


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # a hint for Anthropic's models
    format: Annotated[dict | None, only(None)] = None  # structured output needs a grammar engine


class Metadata(_Strict):
    user_id: str | None = None


class Conversation(_Strict):
    """The fields that make the prompt: shared by /v1/messages and its count_tokens."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1, max_length=100_000)
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool] | None, Field(max_length=128)] = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    diagnostics: dict | None = None
    mcp_servers: Annotated[list | None, only(None, [])] = None  # remote MCP servers: Anthropic's connector

    _tools = field_validator("tools", mode="before")(classmethod(lambda cls, value: _client_tools(value)))

    @model_validator(mode="after")
    def _choice_needs_tools(self):
        choice = self.tool_choice
        if choice is None or choice.type in ("auto", "none"):
            return self
        names = [t.name for t in self.tools or ()]
        if not names:
            raise ValueError(f'tool_choice {{"type": "{choice.type}"}} forces a tool call, but the request has no '
                             "tools")
        if choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names the tool {choice.name!r}, which is not in tools "
                             f"({', '.join(names)})")
        return self

    def system_text(self) -> str:
        if self.system is None:
            return ""
        return self.system if isinstance(self.system, str) else "\n\n".join(b.text for b in self.system)


class MessagesRequest(Conversation):
    max_tokens: int = Field(ge=0, le=MAX_COUNT)
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    container: str | dict | None = None
    inference_geo: str | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _nonempty_stops(cls, value):
        if value is not None and any(not s for s in value):
            raise ValueError("stop_sequences must not hold an empty string")
        return value


class CountTokensRequest(Conversation):
    pass
