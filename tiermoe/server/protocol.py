"""Request bodies of the OpenAI and Ollama APIs, validated by pydantic (unknown fields are ignored, as the
OpenAI server does for fields it does not implement)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_COUNT = 2**31 - 1  # token counts and top_k: far beyond any context, small enough for every kernel
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: str = "text"
    text: str = ""


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if part.type == "text")
        return self.content or ""


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Lenient):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=MAX_COUNT)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        if isinstance(value, list) and (len(value) > 16 or any(not s for s in value)):
            raise ValueError("stop must be at most 16 non-empty strings")
        if isinstance(value, str) and not value:
            raise ValueError("stop must not be empty")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("one prompt per request (a list of several strings is not supported)")
            return value[0]
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value


class OllamaOptions(_Lenient):
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_p: float = Field(default=0.9, gt=0.0, le=1.0)
    top_k: int = Field(default=40, ge=0, le=MAX_COUNT)
    num_predict: int | None = Field(default=None, ge=-2, le=MAX_COUNT)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] | None = None


class OllamaGenerateRequest(_Lenient):
    model: str | None = None
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)


class OllamaChatRequest(_Lenient):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
