"""Anthropic's Messages API, driven by the official `anthropic` client: plain and streamed replies, a system prompt,
a multi-turn conversation with a tool call and its result, forced tools, stop sequences, thinking, count_tokens,
and bad input in Anthropic's error shape. Tool calls and thinking come from text the model is forced to emit
(test_server_reasoning_tools' scripted sampler); greedy text is compared with the OpenAI route's."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from server_thread import server_thread
from test_server_reasoning_tools import forced, model_dir  # noqa: F401 - fixtures

# ChatML that shows tools, an assistant's calls and tool results (as Qwen's template does, shortened)
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>"
    "{{ m['content'] }}</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CONVERSATION = [{"role": "user", "content": "Hello there."},
                {"role": "assistant", "content": [{"type": "text", "text": "Hi! How can I help?"}]},
                {"role": "user", "content": [{"type": "text", "text": "Tell me about the sea."}]}]


@pytest.fixture
def served(model_dir, tmp_path):  # noqa: F811
    def serve(**config):
        return server_thread(tmp_path, model_dir=model_dir, **config)

    return serve


def clients(url: str, key: str = "x") -> tuple[anthropic.Anthropic, openai.OpenAI]:
    return (anthropic.Anthropic(base_url=url, api_key=key, max_retries=0),
            openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0))


def prompts_of(state, monkeypatch) -> list[list[int]]:
    """Every prompt the engine service is given, as ids (and their sampling params beside, in `.params`)."""
    seen = []
    submit = state.service.submit

    def spy(ids, params, **kwargs):
        seen.append(ids)
        spy.params.append(params)
        return submit(ids, params, **kwargs)

    spy.params = []
    monkeypatch.setattr(state.service, "submit", spy)
    return seen


def test_plain_and_streamed_greedy_text_equal_the_openai_routes_and_usage_equals_count_tokens(served):
    with served() as (url, _):
        client, oai = clients(url)
        # the current client sends no sampling fields (older ones do): greedy is asked through extra_body
        request = {"model": "tiny", "max_tokens": 12, "extra_body": {"temperature": 0}, "system": "You are terse.",
                   "messages": CONVERSATION}
        reply = client.messages.create(**request)
        assert reply.type == "message" and reply.role == "assistant" and reply.model == "tiny"
        text = "".join(b.text for b in reply.content if b.type == "text")
        assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens <= 12
        openai_messages = [{"role": "system", "content": "You are terse."}, CONVERSATION[0],
                           {"role": "assistant", "content": "Hi! How can I help?"},
                           {"role": "user", "content": "Tell me about the sea."}]
        same = oai.chat.completions.create(model="tiny", messages=openai_messages, max_tokens=12, temperature=0)
        assert text == same.choices[0].message.content
        assert reply.usage.input_tokens == same.usage.prompt_tokens
        counted = client.messages.count_tokens(model="tiny", system="You are terse.", messages=CONVERSATION)
        assert counted.input_tokens == reply.usage.input_tokens
        with client.messages.stream(**request) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == text and final.stop_reason == reply.stop_reason
        assert final.usage.output_tokens == reply.usage.output_tokens


def test_a_tool_call_is_a_tool_use_block_and_its_result_reaches_the_template(served, forced, monkeypatch):  # noqa: F811
    with served(tool_call_parser="qwen25") as (url, state):
        state.llm.tokenizer.chat_template = TOOL_TEMPLATE
        client, _ = clients(url)
        prompts = prompts_of(state, monkeypatch)
        forced(state.llm.encode(CALL_TEXT))
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        reply = client.messages.create(model="tiny", max_tokens=200, tools=[WEATHER], messages=ask)
        assert [b.type for b in reply.content] == ["text", "tool_use"] and reply.stop_reason == "tool_use"
        text, use = reply.content
        assert text.text == "Let me look." and (use.name, use.input) == ("get_weather", {"city": "Paris"})
        assert use.id.startswith("toolu_")
        with client.messages.stream(model="tiny", max_tokens=200, tools=[WEATHER], messages=ask) as stream:
            final = stream.get_final_message()
        assert [(b.type, getattr(b, "input", None)) for b in final.content] == [
            ("text", None), ("tool_use", {"city": "Paris"})] and final.stop_reason == "tool_use"

        forced(state.llm.encode("It is sunny in Paris."))
        turns = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                     "content": [{"type": "text", "text": "22 C, sunny"}]}]}]
        answer = client.messages.create(model="tiny", max_tokens=50, tools=[WEATHER], messages=turns)
        assert answer.content[0].text == "It is sunny in Paris." and answer.stop_reason == "end_turn"
        shown = state.llm.tokenizer.decode(prompts[-1], skip_special_tokens=False)
        assert shown.startswith("<|im_start|>system\nTools: get_weather")
        assert ('Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                in shown)
        assert shown.endswith("<tool_response>22 C, sunny</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("choice, prompt_end, rest", [
    ({"type": "any"}, "<|im_start|>assistant\n<tool_call>\n",
     '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    ({"type": "tool", "name": "get_weather"}, '<tool_call>\n{"name": "get_weather", "arguments": ',
     '{"city": "Rome"}}\n</tool_call>'),
])
def test_tool_choice_forces_a_call(served, forced, monkeypatch, choice, prompt_end, rest):  # noqa: F811
    with served(tool_call_parser="qwen25") as (url, state):
        client, _ = clients(url)
        prompts = prompts_of(state, monkeypatch)
        forced(state.llm.encode(rest))
        reply = client.messages.create(model="tiny", max_tokens=100, tools=[WEATHER], tool_choice=choice,
                                       messages=[{"role": "user", "content": "Rome?"}])
        assert state.llm.tokenizer.decode(prompts[-1], skip_special_tokens=False).endswith(prompt_end)
        assert [(b.type, b.name, b.input) for b in reply.content] == [("tool_use", "get_weather", {"city": "Rome"})]
        assert reply.stop_reason == "tool_use"


def test_stop_sequences_end_the_reply_before_them_and_say_which(served, forced):  # noqa: F811
    with served() as (url, state):
        client, _ = clients(url)
        forced(state.llm.encode("Hello, dear world. Bye."))
        request = {"model": "tiny", "max_tokens": 60, "stop_sequences": ["world", "Bye"],
                   "messages": [{"role": "user", "content": "hi"}]}
        reply = client.messages.create(**request)
        assert reply.content[0].text == "Hello, dear " and reply.stop_reason == "stop_sequence"
        assert reply.stop_sequence == "world"
        with client.messages.stream(**request) as stream:
            assert "".join(stream.text_stream) == "Hello, dear "
            final = stream.get_final_message()
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "world")
        forced(state.llm.encode("a b c d e f g h"))
        cut = client.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_thinking_comes_back_as_a_thinking_block_streamed_as_thinking_deltas(served, forced, monkeypatch):  # noqa: F811
    with served(reasoning_parser="qwen3") as (url, state):
        client, _ = clients(url)
        state.llm.tokenizer.chat_template = "{% if enable_thinking is defined and not enable_thinking %}NT{% endif %}" \
            + state.llm.tokenizer.chat_template
        prompts = prompts_of(state, monkeypatch)
        forced(state.llm.encode("<think>The sea is big.</think>\n\nIt is vast."))
        request = {"model": "tiny", "max_tokens": 80, "messages": [{"role": "user", "content": "sea?"}]}
        reply = client.messages.create(**request, thinking={"type": "enabled", "budget_tokens": 1024})
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content] == [
            ("thinking", "The sea is big."), ("text", "It is vast.")]
        kinds = []
        with client.messages.stream(**request) as stream:
            for event in stream:
                if event.type == "content_block_delta":
                    kinds.append(event.delta.type)
        assert set(kinds) == {"thinking_delta", "text_delta"} and kinds.index("text_delta") > 0
        client.messages.create(**request, thinking={"type": "disabled"})
        assert state.llm.tokenizer.decode(prompts[-1], skip_special_tokens=False).startswith("NT")
        assert not state.llm.tokenizer.decode(prompts[0], skip_special_tokens=False).startswith("NT")


def test_sampling_fields_are_honoured_when_sent_and_the_checkpoint_defaults_apply_otherwise(served, monkeypatch):
    with served() as (url, state):
        client, _ = clients(url)
        prompts_of(state, monkeypatch)
        params = state.service.submit.params
        ask = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        client.messages.create(**ask, extra_body={"temperature": 0.3, "top_p": 0.5, "top_k": 7})
        client.messages.create(**ask)
        defaults = state.llm.generation_defaults.params({"temperature": 1.0, "top_p": 1.0, "top_k": 0}, max_tokens=2)
        assert (params[0].temperature, params[0].top_p, params[0].top_k) == (0.3, 0.5, 7)
        assert (params[1].temperature, params[1].top_p, params[1].top_k) == (
            defaults.temperature, defaults.top_p, defaults.top_k)


def test_fields_without_local_meaning_are_accepted_and_the_key_may_come_as_x_api_key(served):
    with served(api_key="sekrit") as (url, _):
        client, _ = clients(url, key="sekrit")
        reply = client.messages.create(
            model="tiny", max_tokens=2, metadata={"user_id": "u1"}, service_tier="auto", speed="standard",
            cache_control={"type": "ephemeral"}, system=[{"type": "text", "text": "Be kind.",
                                                           "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            output_config={"effort": "low"}, messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError) as err:
            clients(url, key="wrong")[0].messages.create(model="tiny", max_tokens=2,
                                                         messages=[{"role": "user", "content": "hi"}])
        assert err.value.body == {"type": "error", "error": {
            "type": "authentication_error",
            "message": "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')"}}


BAD = [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens: Field required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "42"}]}]}, 400,
     ("messages.0.content.0: tool_result for tool_use_id 'toolu_x', which is not a tool_use of the assistant "
      "message just before (it made none)")),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400,
     "a content block of type 'image' is not supported by this server"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages.0.content: block 0 (text): text: Field required"),
    ({"max_tokens": 5, "frequency_penalty": 1, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "frequency_penalty: Extra inputs are not permitted"),
    ({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "hi"}]}, 400, "'web_search_20250305' is one of Anthropic's server"),
    ({"max_tokens": 5, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
      "messages": [{"role": "user", "content": "hi"}]}, 400, "output_config.format: is not supported"),
    ({"max_tokens": 5, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER],
      "messages": [{"role": "user", "content": "hi"}]}, 400, "names the tool 'nope', which is not in tools"),
]


@pytest.mark.parametrize("body, status, message", BAD, ids=range(len(BAD)))
def test_bad_requests_are_anthropic_errors_naming_the_problem_and_harm_nothing_else(served, body, status, message):
    with served(max_request_bytes=4096) as (url, _):
        r = httpx.post(url + "/v1/messages", json={"model": "tiny", **body}, timeout=30)
        assert r.status_code == status, r.text
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert message in error["error"]["message"] and "\n" not in error["error"]["message"]
        huge = httpx.post(url + "/v1/messages", json={"model": "tiny", "max_tokens": 5,
                                                       "messages": [{"role": "user", "content": "x" * 5000}]})
        assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"
        ok = clients(url)[0].messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert ok.usage.output_tokens >= 1
