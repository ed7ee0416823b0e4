"""--reasoning-parser and --tool-call-parser: the official openai client gets reasoning_content and tool_calls, streamed
and not, for each supported format (Qwen3, DeepSeek-R1, DeepSeek-V3, GLM-4.5, GPT-OSS), from text the model is
forced to emit (a tiny checkpoint with a byte-level tokenizer, its sampler replaced by a script)."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from server_thread import server_thread
from transformers import AutoTokenizer

import tiermoe.engine.engine as engine_module
from tiermoe.server.output_parsers import OutputParser, keeping_markers
from tiermoe.testing.make_model import make_model

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
# parser pair -> (forced text, reasoning, content, calls)
CASES = {
    ("qwen3", "qwen25"): ("<think>\nLet me check.\n</think>\n\nI'll look it up.\n<tool_call>\n"
                          '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                          "\nLet me check.\n", "I'll look it up.", [CALL]),
    ("deepseek-r1", None): ("The user greets.\n</think>\n\nHello!", "The user greets.\n", "Hello!", []),
    ("deepseek-v3", "deepseekv3"): ("<think>plan</think>Calling.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
                                    '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
                                    "<｜tool▁calls▁end｜>", "plan", "Calling.", [CALL]),
    ("glm45", "glm45"): ("<think>hmm</think>\nSure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>"
                         "Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
                         "hmm", "Sure.", [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]),
    ("gpt-oss", "gpt-oss"): ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
                             "commentary to=functions.get_weather <|constrain|>json<|message|>"
                             '{"city": "Paris"}<|call|>', "Need weather.", None, [CALL]),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen3_moe", tmp_path_factory.mktemp("parsers") / "m", dtype=torch.float32, progress=False,
                      tokenizer=True, config_overrides={"max_position_embeddings": 1024})


@pytest.fixture
def forced(monkeypatch):
    """forced(ids): every sequence samples these ids in order, then the tokenizer's EOS (258)."""
    script = {"ids": []}
    # keyed by the generator itself, which keeps it alive: a finished sequence's id() would be reused by a later
    # sequence's generator, which would then start past the end of the script
    positions: dict[torch.Generator, int] = {}

    def scripted(logits_V, params, gen):
        pos = positions.get(gen, 0)
        positions[gen] = pos + 1
        return script["ids"][pos] if pos < len(script["ids"]) else 258

    monkeypatch.setattr(engine_module, "sample", scripted)
    return lambda ids: script.update(ids=list(ids))


def stream_reply(client, **request) -> tuple[str, str, list[dict], str]:
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("parsers", list(CASES), ids=lambda p: "+".join(filter(None, p)))
def test_the_openai_client_gets_reasoning_and_tool_calls(model_dir, tmp_path, forced, parsers):
    text, reasoning, content, calls = CASES[parsers]
    with server_thread(tmp_path, model_dir=model_dir, reasoning_parser=parsers[0],
                       tool_call_parser=parsers[1]) as (url, state):
        forced(state.llm.encode(text))
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        request = {"model": "tiny", "messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 400,
                   "tools": TOOLS}
        reply = client.chat.completions.create(**request).choices[0]
        assert reply.message.reasoning_content == reasoning and reply.message.content == content
        got = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
               for c in reply.message.tool_calls or []]
        assert got == calls and reply.finish_reason == ("tool_calls" if calls else "stop")
        assert all(c.id and c.type == "function" for c in reply.message.tool_calls or [])
        s_reasoning, s_content, s_calls, s_finish = stream_reply(client, **request)
        assert (s_reasoning, s_content or None) == (reasoning, content)
        assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in s_calls] == calls
        assert s_finish == reply.finish_reason
        if calls:  # without tools in the request the calls stay text, as SGLang does
            plain = client.chat.completions.create(**{**request, "tools": None}).choices[0]
            assert plain.message.tool_calls is None and plain.finish_reason == "stop"


def test_a_tool_conversation_reaches_the_template(model_dir, tmp_path, forced):
    with server_thread(tmp_path, model_dir=model_dir, tool_call_parser="qwen25") as (url, state):
        forced(state.llm.encode("It is sunny."))
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        messages = [{"role": "user", "content": "weather?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=20)
        assert reply.choices[0].message.content == "It is sunny."
        state.llm.tokenizer.chat_template = "{{ tools[0]['function']['name'] }}{{ messages[0]['content'] }}"
        with pytest.raises(openai.BadRequestError, match="chat template refused this conversation"):
            client.chat.completions.create(model="tiny", messages=messages, tools=[{"type": "function"}])


def test_partial_markers_are_held_back_and_harmony_keeps_its_special_tokens(model_dir):
    parser = OutputParser("qwen3", "qwen25")
    assert parser.split("<think>abc</thi", final=False).reasoning == "abc"
    assert parser.split("Hello <tool_", final=False).content == "Hello"  # the space may lead up to a call
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert keeping_markers(tok, ["<|im_start|>"])(ids) == "<|im_start|>hi"


def test_a_think_block_the_template_opens_is_the_replys_reasoning(model_dir, tmp_path, forced):
    """Qwen3's thinking templates end the prompt with `<think>\\n`: the reply starts inside the block. On the parent
    the reasoning and `</think>` came back as content."""
    with server_thread(tmp_path, model_dir=model_dir, reasoning_parser="qwen3", tool_call_parser="qwen25") as (
            url, state):
        state.llm.tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                             "{% if add_generation_prompt %}<think>\n{% endif %}")
        forced(state.llm.encode("Let me check.\n</think>\n\nIt is sunny."))
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        request = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 100}
        reply = client.chat.completions.create(**request).choices[0].message
        assert (reply.reasoning_content, reply.content) == ("Let me check.\n", "It is sunny.")
        reasoning, content, _, _ = stream_reply(client, **request)
        assert (reasoning, content) == ("Let me check.\n", "It is sunny.")
