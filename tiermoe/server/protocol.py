"""Request bodies of the OpenAI and Ollama APIs and SGLang's native /generate, validated by pydantic; the routes declare them in the OpenAPI
schema (tiermoe.server.body.openapi_body).

Every field of the APIs that changes the answer is either implemented or accepted only at its neutral value
(tiermoe.server.unsupported: a 400 otherwise); the sampling and request options every route shares are read into one
RequestOptions by tiermoe.server.request_options, which declares what each route calls them. The value types those
options share (ranges, shapes) are declared once here, so a value is refused alike on every route. vLLM's and
SGLang's extensions to the OpenAI API that change the answer and are not implemented are refused like the others
(`_OpenAIExtensions`). Fields that cannot change the answer are accepted: `user` and `metadata` (labels), Ollama's
`keep_alive` (the model stays loaded) and its load-time options (num_gpu, num_thread, ...: set by the server's own
flags). Names no API here has are ignored, as vLLM and SGLang do (SDKs send extras).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from tiermoe.engine.logprobs import MAX_TOP_LOGPROBS
from tiermoe.errors import TiermoeError
from tiermoe.server.unsupported import UNSUPPORTED, only

MAX_COUNT = 2**31 - 1  # token counts and top_k: far beyond any context, small enough for every kernel
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_CHOICES = 128  # n: OpenAI's bound (and the server's admission bounds a request's sequences further)
# chat_template_kwargs may not set what the server itself passes to the chat template (or that changes what
# apply_chat_template returns: `tokenize`, `return_dict`)
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "return_dict", "return_tensors",
                                      "chat_template", "padding", "truncation", "max_length", "tokenizer_kwargs",
                                      "return_assistant_tokens_mask"})


def _logit_bias_ids(value: dict[str, float] | None) -> dict[str, float] | None:
    for key in value or {}:
        if not key.isascii() or not key.isdigit() or len(key) > 10:
            raise ValueError(f"its keys are token ids (decimal integers >= 0), got {key[:40]!r}")
    return value


def _template_kwargs(value: dict | None) -> dict | None:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value or {}))
    if reserved:
        raise ValueError(f"{', '.join(reserved)} cannot be set here (the server passes it to the chat template)")
    return value


def _json_schema_text(value: str | dict | None) -> str | dict | None:
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except ValueError:
            raise ValueError("is not JSON (a JSON schema, as text)") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("must be a JSON schema: a JSON object")  # noqa: TRY004 - pydantic: the field's 400
    return value


def _not_empty(value: str | None) -> str | None:
    if value is not None and not value:
        raise ValueError("must not be empty")
    return value


# The shared option types (tiermoe.server.request_options reads them): None is "not given".
Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float | None, Field(gt=0.0, le=100.0)]
MinP = Annotated[float | None, Field(ge=0.0, le=1.0)]
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None, AfterValidator(_logit_bias_ids)]
StopTokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_COUNT)]] | None, Field(max_length=64)]
MinTokens = Annotated[int | None, Field(ge=0, le=MAX_COUNT)]
Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES)]
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)]
GrammarText = Annotated[str | None, AfterValidator(_not_empty)]
JsonSchemaText = Annotated[str | None, AfterValidator(_not_empty), AfterValidator(_json_schema_text)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: Literal["text"] = Field("text", description="text only: this server's models read text")
    text: str = ""


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = ""
    name: str | None = None  # handed to the chat template, which may show it
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, handed to the chat template
    tool_call_id: str | None = None  # a tool message: which call it answers
    images: Annotated[list[str] | None, only(None, [])] = None  # Ollama

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value):
        # said here: a union's error would name its first branch ("should be a valid string")
        for part in value if isinstance(value, list) else ():
            kind = part.get("type", "text") if isinstance(part, dict) else "text"
            if kind != "text":
                raise ValueError(f"a content part of type {str(kind)[:40]!r} is not supported by this server "
                                 "(its models read parts of type 'text')")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as a chat template takes it."""
        extra = {name: value for name, value in (("name", self.name), ("tool_calls", self.tool_calls),
                                                 ("tool_call_id", self.tool_call_id)) if value}
        return {"role": self.role, "content": self.text(), **extra}


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs json_schema: {"name": ..., "schema": {...}}')
        return self


# What each API samples with when neither the request nor the checkpoint's generation_config.json gives a value
# (tiermoe.engine.generation_defaults): the fields below default to None, "not given".
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
OLLAMA_SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}
SGLANG_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
SGLANG_MAX_NEW_TOKENS = 128  # sglang.srt.sampling_params.SamplingParams' default


class _OpenAIExtensions(_Lenient):
    """vLLM's and SGLang's extensions to OpenAI's requests that would change the answer and are not implemented:
    refused unless neutral, rather than ignored like names no API has."""

    use_beam_search: Annotated[bool | None, only(None, False)] = None
    length_penalty: Annotated[float | None, only(None, 1.0)] = None
    include_stop_str_in_output: Annotated[bool | None, only(None, False)] = None
    no_stop_trim: Annotated[bool | None, only(None, False)] = None
    allowed_token_ids: Annotated[list | None, only(None)] = None
    bad_words: Annotated[list | None, only(None, [])] = None
    guided_json: Annotated[Any, only(None)] = None
    guided_regex: Annotated[Any, only(None)] = None
    guided_choice: Annotated[Any, only(None)] = None
    guided_grammar: Annotated[Any, only(None)] = None
    structural_tag: Annotated[Any, only(None)] = None
    logits_processors: Annotated[Any, only(None)] = None
    truncate_prompt_tokens: Annotated[int | None, only(None)] = None
    prompt_logprobs: Annotated[int | None, only(None)] = None
    return_hidden_states: Annotated[bool | None, only(None, False)] = None


class _SamplingFields(_OpenAIExtensions):
    model: str | None = None  # "<served name>:ADAPTER" asks for a LoRA adapter (tiermoe.server.request_options)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_COUNT)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: StopTokenIds = None
    n: Choices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    repetition_penalty: RepetitionPenalty = None
    min_p: MinP = None
    logit_bias: LogitBias = None
    min_tokens: MinTokens = None
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    regex: GrammarText = None
    json_schema: Annotated[str | dict | None, AfterValidator(_json_schema_text)] = None
    ebnf: GrammarText = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        if isinstance(value, list) and (len(value) > 16 or any(not s for s in value)):
            raise ValueError("stop must be at most 16 non-empty strings")
        if isinstance(value, str) and not value:
            raise ValueError("stop must not be empty")
        return value


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = Field(default=None, max_length=128)  # handed to the chat template
    # "required" or a named function ({"type": "function", "function": {"name": ...}}) forces a call, with
    # --tool-call-parser (tiermoe.server.forced_calls: the reply is begun inside a call, no grammar engine)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # accepted: every call the model writes is returned
    functions: Annotated[list[Any] | None, only(None, [])] = None
    function_call: Annotated[str | dict | None, only(None, "none", "auto")] = None
    chat_template_kwargs: TemplateKwargs = None  # variables the chat template reads (e.g. enable_thinking)
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    separate_reasoning: bool = True  # false: the reasoning stays in content (no reasoning parser for this request)
    add_generation_prompt: Annotated[bool | None, only(None, True)] = None
    chat_template: Annotated[str | None, only(None)] = None
    documents: Annotated[list | None, only(None, [])] = None
    echo: Annotated[bool | None, only(None, False)] = None
    modalities: Annotated[list[str] | None, only(None, ["text"])] = None
    audio: Annotated[dict | None, only(None)] = None
    prediction: Annotated[dict | None, only(None)] = None
    reasoning_effort: Annotated[str | None, only(None)] = None
    web_search_options: Annotated[dict | None, only(None)] = None
    service_tier: Annotated[str | None, only(None, "auto", "default")] = None
    store: Annotated[bool | None, only(None, False)] = None
    metadata: dict[str, str] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, value):
        named = isinstance(value, dict) and value.get("type") == "function" and isinstance(
            value.get("function"), dict) and isinstance(value["function"].get("name"), str)
        if value in (None, "none", "auto", "required") or named:
            return {"type": "function", "function": {"name": value["function"]["name"]}} if named else value
        raise ValueError(f'{UNSUPPORTED}; accepted: null, "none", "auto", "required", '
                         '{"type": "function", "function": {"name": NAME}}')

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _continues_an_assistant_message(self):
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a conversation that ends with an assistant message")
        return self

    @model_validator(mode="after")
    def _forced_call_needs_its_tool(self):
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return self
        if not self.tools:
            raise ValueError(f"tool_choice {json.dumps(choice)} forces a tool call, but the request has no tools")
        if isinstance(choice, dict):
            names = [t.get("function", {}).get("name") for t in self.tools if isinstance(t.get("function"), dict)]
            if choice["function"]["name"] not in names:
                raise ValueError(f"tool_choice names the function {json.dumps(choice['function']['name'])}, which "
                                 f"is not in tools ({', '.join(map(str, names)) or 'none named'})")
        return self

    def logprobs_asked(self) -> int | None:
        """Alternatives per generated token (SamplingParams.logprobs), None when no logprobs are asked."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    """`prompt`: one text or token-id list, or several (a list of texts or of token-id lists), as OpenAI and SGLang
    take them: one choice per prompt, `index` its place in the list."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT, description="0 (with echo) scores the prompt")
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: Annotated[int | None, only(None, 1)] = None
    suffix: Annotated[str | None, only(None, "")] = None

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo: true (it returns the prompt, scored with logprobs)")
        return self

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, value):
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("prompt must not be empty (nor any prompt of a list)")
        return value

    def is_batch(self) -> bool:
        return isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list))

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or its token ids."""
        return list(self.prompt) if self.is_batch() else [self.prompt]


class OllamaOptions(_Lenient):
    """Ollama's sampling options; its load-time ones (num_ctx, num_gpu, num_thread, use_mmap, ...) configure its
    own runner and are ignored here like names it does not know (the server's flags size this one)."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    num_predict: int | None = Field(default=None, ge=-2, le=MAX_COUNT)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] | None = None
    repeat_penalty: RepetitionPenalty = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    min_p: MinP = None
    typical_p: Annotated[float | None, only(None, 1.0)] = None
    tfs_z: Annotated[float | None, only(None, 1.0)] = None
    mirostat: Annotated[int | None, only(None, 0)] = None


class _OllamaFields(_Lenient):
    model: str | None = None
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    keep_alive: str | int | float | None = None  # the model stays loaded
    format: str | dict | None = None  # "json" or a JSON schema: structured output (tiermoe.server.request_options)
    think: Annotated[bool | str | None, only(None, False)] = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("format")
    @classmethod
    def _format_shape(cls, value):
        if isinstance(value, str) and value not in ("", "json"):
            raise ValueError('format is "json" or a JSON schema (an object)')
        return value

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class OllamaGenerateRequest(_OllamaFields):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: Annotated[str | None, only(None, "")] = None
    images: Annotated[list[str] | None, only(None, [])] = None
    template: Annotated[str | None, only(None, "")] = None
    context: Annotated[list[int] | None, only(None, [])] = None


class OllamaChatRequest(_OllamaFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict] | None = Field(default=None, max_length=128)  # handed to the chat template (ollama_reply)


class OllamaShowRequest(_Lenient):
    model: str | None = None
    name: str | None = None  # the field's name before Ollama 0.3
    verbose: bool = False


class SGLangSamplingParams(_Lenient):
    """SGLang's `sampling_params` (sglang.srt.sampling_params.SamplingParams): top_k -1 (or 0) keeps every token;
    an absent max_new_tokens is SGLang's 128 (less where the context has less room)."""

    max_new_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_COUNT)
    sampling_seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: StopTokenIds = None
    ignore_eos: bool = False
    n: Choices = 1
    stream_interval: int | None = None  # how often SGLang streams: every token here, the answer is the same
    spaces_between_special_tokens: bool = True  # how a slow tokenizer joins kept special tokens; fast ones: no-op
    skip_special_tokens: bool = True
    min_new_tokens: MinTokens = None
    min_p: MinP = None
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    repetition_penalty: RepetitionPenalty = None
    no_stop_trim: Annotated[bool, only(False)] = False
    regex: GrammarText = None
    json_schema: JsonSchemaText = None
    ebnf: GrammarText = None
    structural_tag: Annotated[str | None, only(None)] = None
    logit_bias: LogitBias = None
    custom_params: Annotated[dict | None, only(None)] = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        return _SamplingFields._stop_strings(value)


class SGLangGenerateRequest(_Lenient):
    """SGLang's GenerateReqInput: one prompt (`text`, or `input_ids`) or a batch (a list of either), with one
    `sampling_params` for all or a list of one per prompt."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    log_metrics: bool = True
    return_text_in_logprobs: bool = False  # about logprobs, which must be off
    return_logprob: Annotated[bool | list[bool] | None, only(None, False)] = None
    logprob_start_len: Annotated[int | list[int] | None, only(None, -1)] = None
    top_logprobs_num: Annotated[int | list[int] | None, only(None, 0)] = None
    return_hidden_states: Annotated[bool | None, only(None, False)] = None
    input_embeds: Annotated[list | None, only(None)] = None
    image_data: Annotated[Any, only(None)] = None
    audio_data: Annotated[Any, only(None)] = None
    video_data: Annotated[Any, only(None)] = None
    lora_path: str | list[str | None] | None = None  # an adapter by name (tiermoe.server.request_options)
    session_params: Annotated[dict | None, only(None)] = None
    custom_logit_processor: Annotated[str | list | None, only(None)] = None

    @model_validator(mode="after")
    def _one_batch(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("either text or input_ids should be provided (one of them)")
        prompts = self.prompts()
        if not prompts or any(isinstance(p, list) and not p for p in prompts):
            raise ValueError("a prompt must not be empty" if prompts else "the batch of prompts is empty")
        for name in ("sampling_params", "rid", "lora_path"):
            value = getattr(self, name)
            if isinstance(value, list) and (not self.is_batch() or len(value) != len(prompts)):
                raise ValueError(f"{name} is a list: it needs a batch of prompts of the same length "
                                 f"({len(value)} given for {len(prompts) if self.is_batch() else 'one prompt'})")
        return self

    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or its token ids."""
        prompt = self.text if self.text is not None else self.input_ids
        return list(prompt) if self.is_batch() else [prompt]

    def params(self, index: int) -> SGLangSamplingParams:
        value = self.sampling_params
        if isinstance(value, list):
            return value[index]
        return value if value is not None else SGLangSamplingParams()

    def one_prompt(self, index: int) -> SGLangPrompt:
        """What applies to prompt `index`: its sampling_params and lora_path (a list gives each prompt its own)."""
        return SGLangPrompt(self.params(index), self.lora_path[index] if isinstance(self.lora_path, list)
                            else self.lora_path)

    def choices(self) -> int:
        """n, the same for every prompt (SGLang's parallel sampling)."""
        counts = {self.params(i).n for i in range(len(self.prompts()))}
        if len(counts) > 1:
            raise TiermoeError(f"sampling_params.n must be the same for every prompt, got {sorted(counts)}")
        return counts.pop()

    def request_id(self, index: int) -> str | None:
        return self.rid[index] if isinstance(self.rid, list) else (self.rid if not self.is_batch() else None)


@dataclass(frozen=True)
class SGLangPrompt:
    """One prompt's share of a /generate request, as tiermoe.server.request_options reads it."""

    sampling_params: SGLangSamplingParams
    lora_path: str | None
