"""One layer of request options for every generation route: what each API calls a sampling or request option, and
how its value becomes the engine's SamplingParams, the prompt's rendering (chat_template_kwargs,
continue_final_message) or the reply's parsing (separate_reasoning).

`OPTIONS` declares each option once: the request fields it is read from on each route (the OpenAI routes, SGLang's
/generate, Ollama's), and what it does. `read_options` reads a request into one RequestOptions by those
declarations, so an option means the same on every route that has it, and a route without a field simply lacks
it. Its values' ranges and shapes are the pydantic types of tiermoe.server.protocol, shared by the routes (a bad
value is a 400 naming the field before anything here runs); what needs the server's state (token ids inside the
vocabulary, an adapter that is loaded, n within the admission's capacity) is checked here and by
ServerState.sampling, also as a 400 naming the field. docs/server-api.md's table of fields x routes is rendered from
these declarations (tiermoe.server.request_options_table).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from tiermoe.config import ServerConfig
from tiermoe.engine.sampling import Grammar, SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.server.protocol import SEED_MAX

ROUTES = ("chat", "completions", "generate", "ollama")
ROUTE_PATHS = {"chat": ("/v1/chat/completions",), "completions": ("/v1/completions",), "generate": ("/generate",),
               "ollama": ("/api/chat", "/api/generate")}
BASE_MODEL_TAG = "latest"  # "<served name>:latest" is the model itself, as Ollama's clients name it


@dataclass(frozen=True)
class Reading:
    """What reading one request's options needs: its route, the served model's name, the adapters loaded."""

    route: str
    served_name: str = ""
    adapters: Collection[str] = ()
    compile_grammar: Callable[[Grammar], Any] | None = None  # checks a grammar (the model's LLM.compile_grammar)


Take = Callable[[dict[str, Any], Reading], Any]


def _first_given(values: dict[str, Any], reading: Reading) -> Any:
    return next((v for v in values.values() if v is not None), None)


@dataclass(frozen=True)
class Option:
    """One request option: `key` its RequestOptions attribute; `fields` route -> the request fields it is read from
    (dotted: inside `sampling_params` or `options`); `take` turns those fields' values into the option's value (the
    first one given, by default); `does` says what it does (the doc's words)."""

    key: str
    fields: Mapping[str, tuple[str, ...]]
    does: str
    take: Take = _first_given


def _openai_and(generate: str | None = None, ollama: str | None = None, chat_only: bool = False,
                openai: tuple[str, ...] | None = None, key: str = "") -> dict[str, tuple[str, ...]]:
    """The usual layout: the same name on both OpenAI routes, its own in sampling_params and Ollama's options."""
    names = openai or (key,)
    fields = {"chat": names} if chat_only else {"chat": names, "completions": names}
    if generate:
        fields["generate"] = (f"sampling_params.{generate}",)
    if ollama:
        fields["ollama"] = (f"options.{ollama}",)
    return fields


def _everywhere(key: str, generate: str | None = None, ollama: str | None = None) -> dict[str, tuple[str, ...]]:
    return _openai_and(generate or key, ollama or key, key=key)


def _max_tokens(values: dict[str, Any], reading: Reading) -> int | None:
    value = _first_given(values, reading)
    if reading.route == "ollama":  # num_predict -1 (until the context is full) and -2 (fill it): the default
        return value if value is not None and value > 0 else None
    return value


def _top_k(values: dict[str, Any], reading: Reading) -> int | None:
    value = _first_given(values, reading)
    return None if value is None else max(0, value)  # OpenAI's and SGLang's -1 (all tokens): SamplingParams' 0


def _stop(values: dict[str, Any], reading: Reading) -> tuple[str, ...]:
    value = _first_given(values, reading)
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def _ids(values: dict[str, Any], reading: Reading) -> tuple[int, ...]:
    return tuple(_first_given(values, reading) or ())


def _logit_bias(values: dict[str, Any], reading: Reading) -> dict[int, float] | None:
    value = _first_given(values, reading)
    if not value:  # absent, null, or {}: no bias
        return None
    return {int(token): bias for token, bias in value.items()}


def _grammar(values: dict[str, Any], reading: Reading) -> Grammar | None:
    """The one grammar the request's structured-output fields give (response_format, regex, json_schema, ebnf;
    Ollama's format), compiled here (cached) so that what is wrong or unsupported in it is a 400 naming the field
    before anything runs."""
    given = {path: grammar for path, value in values.items() if (grammar := _grammar_of(path, value)) is not None}
    if not given:
        return None
    if len(given) > 1:
        raise TiermoeError(f"{', '.join(given)}: each constrains the reply; give one of them")
    [(path, grammar)] = given.items()
    if reading.compile_grammar is not None:
        try:
            reading.compile_grammar(grammar)
        except TiermoeError as err:
            raise TiermoeError(f"{path}: {err}") from None
    return grammar


def _grammar_of(path: str, value) -> Grammar | None:
    name = path.rsplit(".", 1)[-1]
    if value is None or value == "":
        return None
    if name == "response_format":  # protocol.ResponseFormat
        if value.type == "text":
            return None
        schema = value.json_schema.schema_ if value.json_schema is not None else None
        return Grammar("json_object") if value.type == "json_object" else Grammar("json_schema", _json(schema))
    if name == "format":  # Ollama's: "json", or a JSON schema
        return Grammar("json_object") if value == "json" else Grammar("json_schema", _json(value))
    if name == "json_schema":
        return Grammar("json_schema", value if isinstance(value, str) else _json(value))
    return Grammar(name, value)  # regex, ebnf


def _json(value) -> str:
    return json.dumps(value, sort_keys=True)


def _adapter(values: dict[str, Any], reading: Reading) -> str | None:
    """The LoRA adapter asked for: SGLang's lora_path (its name), or an OpenAI model named `<served name>:NAME`
    (SGLang's) or `NAME` (vLLM's: a loaded adapter's name; another model name is the served model, as on every
    route)."""
    [(path, value)] = values.items()
    if value is None:
        return None
    if path == "model":
        if value in reading.adapters and value != reading.served_name:
            return value
        prefix = f"{reading.served_name}:"
        if not reading.served_name or not value.startswith(prefix) or value == prefix + BASE_MODEL_TAG:
            return None
        value = value.removeprefix(prefix)
    if value not in reading.adapters:
        loaded = f"loaded: {', '.join(sorted(reading.adapters))}" if reading.adapters else "none is loaded"
        raise TiermoeError(f"{path}: there is no LoRA adapter {value[:80]!r} on this server ({loaded})")
    return value


OPTIONS: tuple[Option, ...] = (
    Option("max_tokens", {"chat": ("max_completion_tokens", "max_tokens"), "completions": ("max_tokens",),
                          "generate": ("sampling_params.max_new_tokens",), "ollama": ("options.num_predict",)},
           "tokens to generate at most, within the context and `--max-total-tokens`; absent (Ollama: <= 0): "
           "`--default-max-tokens` (SGLang: 128)", _max_tokens),
    Option("temperature", _everywhere("temperature"),
           "below 1e-5 greedy; absent: the checkpoint's `generation_config.json`, else the API's default (1; Ollama "
           "0.8)"),
    Option("top_p", _everywhere("top_p"), "nucleus sampling; absent: as temperature (1; Ollama 0.9)"),
    Option("top_k", _everywhere("top_k"), "the k most likely tokens (-1 or 0: all); absent: as temperature (all; "
           "Ollama 40)", _top_k),
    Option("seed", _everywhere("seed", generate="sampling_seed"),
           "reproducible sampling; with n > 1, choice i samples with seed + i"),
    Option("stop", _everywhere("stop"), "at most 16 strings; the answer ends before the first match", _stop),
    Option("stop_token_ids", _openai_and("stop_token_ids", key="stop_token_ids"),
           "token ids that end the answer (kept in it, as EOS is)", _ids),
    Option("ignore_eos", _openai_and("ignore_eos", key="ignore_eos"), "EOS does not end the answer"),
    Option("presence_penalty", _everywhere("presence_penalty"),
           "-2 to 2: `presence * (count > 0)` subtracted from each token's logit, by its count in the output"),
    Option("frequency_penalty", _everywhere("frequency_penalty"),
           "-2 to 2: `frequency * count` subtracted from each token's logit, by its count in the output"),
    Option("repetition_penalty", _everywhere("repetition_penalty", ollama="repeat_penalty"),
           "(0, 100], 1 off: logits of tokens in the prompt or the output divided by it (multiplied when "
           "negative); Ollama's `repeat_last_n` window is not applied: the whole prompt and output count"),
    Option("min_p", _everywhere("min_p"), "0 to 1: tokens less likely than min_p times the most likely are dropped"),
    Option("logit_bias", _openai_and("logit_bias", key="logit_bias"),
           "`{\"TOKEN_ID\": bias}`, bias -100 to 100 added to that token's logit (ids inside the vocabulary)",
           _logit_bias),
    Option("min_tokens", _openai_and("min_new_tokens", key="min_tokens"),
           "EOS and stop_token_ids cannot end the answer (nor stop strings) before this many tokens; at most "
           "max_tokens"),
    Option("n", _openai_and("n", key="n"),
           "choices per prompt, each its own sequence (an admission slot each: a 400 beyond the server's "
           "`--max-running-requests` + `--max-queued-requests`); `choices[].index` = prompt x n + choice, a stream "
           "interleaves them; /generate answers a list of prompts x n"),
    Option("skip_special_tokens", _openai_and("skip_special_tokens", key="skip_special_tokens"),
           "false: the answer's text keeps special tokens (stop strings are searched in that text)"),
    Option("grammar", {"chat": ("response_format", "regex", "json_schema", "ebnf"),
                       "completions": ("response_format", "regex", "json_schema", "ebnf"),
                       "generate": ("sampling_params.regex", "sampling_params.json_schema", "sampling_params.ebnf"),
                       "ollama": ("format",)},
           "structured output (`response_format` `json_object`/`json_schema`, a regex, an EBNF grammar; Ollama "
           "`\"json\"` or a schema): the reply is held to it, step by step; a 400 names what a schema uses that "
           "cannot be enforced "
           "(`response_format` `{\"type\": \"text\"}` asks for nothing)", _grammar),
    Option("chat_template_kwargs", {"chat": ("chat_template_kwargs",)},
           "variables the chat template reads (e.g. `enable_thinking`); not the ones the server sets itself"),
    Option("continue_final_message", {"chat": ("continue_final_message",)},
           "the reply continues the conversation's last (assistant) message instead of starting a new one"),
    Option("separate_reasoning", {"chat": ("separate_reasoning",)},
           "false: with `--reasoning-parser`, the reasoning stays in `content` (no `reasoning_content`)"),
    Option("adapter", {"chat": ("model",), "completions": ("model",), "generate": ("lora_path",)},
           "a LoRA adapter served per request, by name: `model` `\"<served name>:NAME\"` (SGLang's) or `\"NAME\"` "
           "(vLLM's; another name is the served model), `lora_path` NAME (a list: one per prompt); one that is not "
           "loaded is a 400 naming it and the loaded ones", _adapter),
)
OPTION_BY_KEY = {option.key: option for option in OPTIONS}


@dataclass(frozen=True)
class RequestOptions:
    """One request's options, route-neutral (None: not given; the defaults are the API's or the checkpoint's)."""

    route: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    grammar: Grammar | None = None
    chat_template_kwargs: dict | None = None
    continue_final_message: bool = False
    separate_reasoning: bool = True
    adapter: str | None = None

    def field(self, key: str) -> str:
        """The request field an option is read from on this route (for messages that name it)."""
        option = OPTION_BY_KEY.get(key)
        fields = option.fields.get(self.route) if option is not None else None
        return fields[0] if fields else key

    def sampling_values(self) -> dict[str, Any]:
        """SamplingParams' values this request gives (None: not given), max_tokens aside."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": self.stop, "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "min_p": self.min_p, "logit_bias": self.logit_bias,
                "min_tokens": self.min_tokens, "skip_special_tokens": self.skip_special_tokens,
                "grammar": self.grammar, "adapter": self.adapter}


def read_options(route: str, source, served_name: str = "", adapters: Collection[str] = (),
                 compile_grammar: Callable[[Grammar], Any] | None = None) -> RequestOptions:
    """The options of a request `source` of `route` (the validated body; for /generate one prompt's share,
    protocol.SGLangPrompt), by OPTIONS. TiermoeError (a 400 naming the field) for an adapter that is not loaded or
    a grammar."""
    reading = Reading(route, served_name, adapters, compile_grammar)
    values = {}
    for option in OPTIONS:
        paths = option.fields.get(route)
        if paths:
            values[option.key] = option.take({path: _read(source, path) for path in paths}, reading)
    return RequestOptions(route, **{k: v for k, v in values.items() if v is not None})


def _read(source, path: str):
    for name in path.split("."):
        source = getattr(source, name)
    return source


def check_sequences(config: ServerConfig, prompts: int, options: RequestOptions) -> int:
    """The sequences a request of `prompts` prompts runs (n each), refused (a 400 naming n) when the server cannot
    hold them all at once; each takes an admission slot (tiermoe.server.admission.take_batch)."""
    config.check_prompt_batch(prompts)
    sequences = prompts * options.n
    if sequences > config.in_flight_limit:
        raise TiermoeError(f"{options.field('n')}: {options.n} choices for {prompts} prompt(s) is {sequences} "
                           f"sequences, more than this server holds at once ({config.in_flight_limit}: "
                           "--max-running-requests + --max-queued-requests)")
    return sequences


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """SamplingParams for each of n choices: choice i samples with seed + i (a seeded request stays reproducible,
    and its choices differ; choice 0 is the answer the request gives with n 1)."""
    if n == 1 or params.seed is None:
        return [params] * n
    return [params] + [dataclasses.replace(params, seed=(params.seed + i) % (SEED_MAX + 1)) for i in range(1, n)]
