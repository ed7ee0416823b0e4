"""tool_choice "required" and a named function force a call with each --tool-call-parser format: the prompt ends
with the format's call opening, and the official openai client gets the call (streamed and not) from the rest of
the call, which the model is forced to emit (test_server_reasoning_tools' scripted sampler)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_thread import server_thread
from test_server_reasoning_tools import TOOLS, forced, model_dir, stream_reply  # noqa: F401 - fixtures

from tiermoe.testing.checkpoint_tokenizer import CHATML

DS_REST = "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
ARGS = {"city": "Paris"}
# tool parser -> (reasoning parser, the template's generation prompt opens a think block,
#                 the prompt's ending for "required" / for the named get_weather, what the model emits after each)
FORMATS = {
    "qwen25": ("qwen3", False, "<tool_call>\n", '<tool_call>\n{"name": "get_weather", "arguments": ',
               '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               '{"city": "Paris"}}\n</tool_call>'),
    "deepseekv3": ("deepseek-r1", True, "</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>",
                   "</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n",
                   'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```' + DS_REST,
                   '{"city": "Paris"}\n```' + DS_REST),
    "glm45": ("glm45", False, "<tool_call>", "<tool_call>get_weather\n",
              "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
              "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
    "gpt-oss": ("gpt-oss", False, "<|channel|>commentary to=functions.",
                "<|channel|>commentary to=functions.get_weather",
                'get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
                ' <|constrain|>json<|message|>{"city": "Paris"}<|call|>'),
}
OTHER_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_parser", list(FORMATS))
def test_a_forced_call_comes_back_as_tool_calls(model_dir, tmp_path, forced, monkeypatch, tool_parser):  # noqa: F811
    reasoning, opens_think, required_end, named_end, required_rest, named_rest = FORMATS[tool_parser]
    with server_thread(tmp_path, model_dir=model_dir, reasoning_parser=reasoning,
                       tool_call_parser=tool_parser) as (url, state):
        if opens_think:  # as DeepSeek-R1's template does
            state.llm.tokenizer.chat_template = CHATML.replace("assistant\n", "assistant\n<think>\n")
        prompts = []
        submit = state.service.submit
        monkeypatch.setattr(state.service, "submit",
                            lambda ids, params, **kwargs: prompts.append(ids) or submit(ids, params, **kwargs))
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        request = {"model": "tiny", "messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 300,
                   "tools": [OTHER_TOOL, *TOOLS]}
        for choice, prompt_end, rest in (("required", required_end, required_rest), (NAMED, named_end, named_rest)):
            forced(state.llm.encode(rest))
            reply = client.chat.completions.create(**request, tool_choice=choice).choices[0]
            assert state.llm.tokenizer.decode(prompts[-1], skip_special_tokens=False).endswith(prompt_end)
            got = [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls or []]
            assert got == [("get_weather", ARGS)] and reply.finish_reason == "tool_calls", reply
            assert not reply.message.content and not getattr(reply.message, "reasoning_content", None)
            s_reasoning, s_content, s_calls, s_finish = stream_reply(client, **request, tool_choice=choice)
            assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == [("get_weather", ARGS)]
            assert (s_reasoning, s_content, s_finish) == ("", "", "tool_calls")


def test_a_call_that_cannot_be_forced_is_a_one_line_400(model_dir, tmp_path):  # noqa: F811
    messages = [{"role": "user", "content": "weather?"}]
    with server_thread(tmp_path, model_dir=model_dir, tool_call_parser="qwen25") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        with pytest.raises(openai.BadRequestError, match="get_time.*not in tools") as err:
            client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=5,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert "\n" not in err.value.body["message"]
        with pytest.raises(openai.BadRequestError, match="no tools"):
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, tool_choice="required")
    with server_thread(tmp_path, model_dir=model_dir) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        for choice in ("required", NAMED):
            with pytest.raises(openai.BadRequestError, match="needs the server started with --tool-call-parser"):
                client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=5,
                                               tool_choice=choice)


def ollama_chat(url: str, **body) -> dict | list[dict]:
    r = httpx.post(url + "/api/chat", json={"model": "tiny", "options": {"num_predict": 300}, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines()] if body.get("stream", True) else r.json()


def test_ollama_chat_takes_tools_and_answers_with_its_tool_calls(model_dir, tmp_path, forced):  # noqa: F811
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                 "arguments": ARGS}}]},
               {"role": "tool", "content": "sunny"}, {"role": "user", "content": "and tomorrow?"}]
    with server_thread(tmp_path, model_dir=model_dir, tool_call_parser="qwen25") as (url, state):
        forced(state.llm.encode('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                '"day": 2}}\n</tool_call>'))
        call = {"function": {"name": "get_weather", "arguments": {**ARGS, "day": 2}}}
        reply = ollama_chat(url, messages=history, tools=TOOLS, stream=False)
        assert reply["message"] == {"role": "assistant", "content": "Checking.", "tool_calls": [call]}
        assert reply["done"] and reply["done_reason"] == "stop"
        lines = ollama_chat(url, messages=history, tools=TOOLS)
        assert "".join(line["message"]["content"] for line in lines) == "Checking."
        assert [c for line in lines for c in line["message"].get("tool_calls", [])] == [call]
        assert lines[-1]["done"] and not any(line["done"] for line in lines[:-1])
        plain = ollama_chat(url, messages=history, stream=False)  # without tools the call stays text
        assert "tool_calls" not in plain["message"] and "<tool_call>" in plain["message"]["content"]
        show = httpx.post(url + "/api/show", json={"model": "tiny"}, timeout=60).json()
        assert show["capabilities"] == ["completion", "tools"]
