"""Reasoning and tool calls in the forms real models write them (issue: replies and request options, class 1): for
each parser, a table of replies (canonical, variants, cut off by max_tokens, malformed, interleaved with text)
split whole and streamed in pieces alike, and no reply text vanishes: what a parser cannot read stays in content.
Markers that a tokenizer marks special survive decoding."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tiermoe.server.output_parsers import OutputParser, StreamSplitter, keeping_markers
from tiermoe.server.tool_call_formats import (
    DS_CALL,
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    DS_SEP,
)

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ARGS = '{"city": "Paris"}'
QWEN_CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
CUT_QWEN = '<tool_call>\n{"name": "get_weather", "argu'
BAD_QWEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>'
DS_V3 = f"{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{ARGS}\n```{DS_CALL_END}{DS_CALLS_END}"
DS_V31 = f"{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{ARGS}{DS_CALL_END}{DS_CALLS_END}"
DS_CUT = f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Pa'
GLM_CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
HARMONY_CALL = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"

# (reasoning parser, tool parser, the reply's opening from the prompt) -> [(reply, reasoning, content, calls)]
CASES = {
    ("qwen3", "qwen25", ""): [
        (f"<think>\nLet me check.\n</think>\n\nI'll look it up.\n{QWEN_CALL}", "\nLet me check.\n",
         "I'll look it up.", [CALL]),
        (f"Sure.\n{BAD_QWEN}", "", f"Sure.\n{BAD_QWEN}", []),  # invalid JSON: the block stays, verbatim
        (f"{QWEN_CALL}\nDone, the weather is coming.", "", "\nDone, the weather is coming.", [CALL]),
        ("Write <tool_call> tags to call tools.", "", "Write <tool_call> tags to call tools.", []),  # in prose
        (f"First.\n{QWEN_CALL}\nThen.{QWEN_CALL}", "", "First.\n\nThen.", [CALL, CALL]),  # interleaved with text
        (f"Checking. {CUT_QWEN}", "", f"Checking. {CUT_QWEN}", []),  # cut off by max_tokens
        ("<think>still thinking when max_tokens", "still thinking when max_tokens", "", []),
    ],
    # Qwen3's thinking templates open the think block in the prompt: the reply starts inside it
    ("qwen3", "qwen25", "<think>"): [
        ("Let me check.\n</think>\n\nIt is sunny.", "Let me check.\n", "It is sunny.", []),
    ],
    ("deepseek-r1", None, ""): [
        ("The user greets.\n</think>\n\nHello!", "The user greets.\n", "Hello!", []),
    ],
    ("deepseek-v3", "deepseekv3", ""): [
        (f"<think>plan</think>Calling.{DS_V3}", "plan", "Calling.", [CALL]),
        (f"Calling.{DS_V31}", "", "Calling.", [CALL]),  # DeepSeek-V3.1's form
        (f"{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{bad json{DS_CALL_END}{DS_CALLS_END}", "",
         f"{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{bad json{DS_CALL_END}{DS_CALLS_END}", []),
    ],
    ("deepseek-v3", "deepseekv31", ""): [
        (f"{DS_V31}", "", "", [CALL]),
        (DS_CUT, "", DS_CUT, []),  # cut off by max_tokens
    ],
    ("glm45", "glm45", ""): [
        (f"<think>hmm</think>\nSure.\n{GLM_CALL}", "hmm", "Sure.", [CALL]),
        ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", "", "", [CALL]),
        ("Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key><arg_val", "",  # cut off by max_tokens
         "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key><arg_val", []),
    ],
    ("gpt-oss", "gpt-oss", ""): [
        (f"<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant{HARMONY_CALL}", "Need weather.", "",
         [CALL]),
        # the recipient in the role header (the prompt ended with `<|start|>assistant`)
        (f" to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>", "", "", [CALL]),
        (("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant to=functions.get_weather<|channel|>"
          f"commentary json<|message|>{ARGS}<|call|>"), "Think.", "", [CALL]),
        # a commentary preamble with no recipient is the answer's, as the final channel is
        (("<|channel|>commentary<|message|>Let me look. <|end|><|start|>assistant<|channel|>final<|message|>"
          "Sunny.<|return|>"), "", "Let me look. Sunny.", []),
        ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Pa", "",
         "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Pa", []),
        ("Plain text from a model that writes no harmony.", "", "Plain text from a model that writes no harmony.", []),
    ],
}
SYNTAX_WORDS = {"function", "json", "analysis", "commentary", "final", "assistant", "to", "functions", "name",
                "arguments", "constrain"}
PARAMS = [(key, case) for key, cases in CASES.items() for case in cases]


def stream(parser: OutputParser, prefix: str, reply: str, sizes) -> tuple[str, str, list[dict]]:
    splitter, reasoning, content, calls, at = StreamSplitter(parser, prefix), "", "", [], 0
    while at < len(reply):
        size = next(sizes)
        r, c, k = splitter.feed(reply[at:at + size], final=at + size >= len(reply))
        reasoning, content, calls, at = reasoning + r, content + c, calls + k, at + size
    return reasoning, content, calls


def words(text: str, markers) -> Counter:
    for marker in markers:
        text = text.replace(marker, " ")
    return Counter(w for w in re.findall(r"\w+", text) if w not in SYNTAX_WORDS)


@pytest.mark.parametrize("key, case", PARAMS, ids=[f"{k[1] or k[0]}-{i}" for i, (k, _) in enumerate(PARAMS)])
def test_each_reply_splits_alike_whole_and_streamed_and_loses_no_text(key, case):
    reasoning_parser, tool_parser, prefix = key
    reply, reasoning, content, calls = case
    parser = OutputParser(reasoning_parser, tool_parser)
    splitter = StreamSplitter(parser, prefix)
    whole = splitter.feed(reply, final=True)
    got = (whole[0], whole[1], [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in whole[2]])
    assert got == (reasoning, content, calls)
    for sizes in ([1], [2, 5, 3], [len(reply)]):  # a character a step, uneven pieces, one piece
        cycle = (sizes[i % len(sizes)] for i in range(10 ** 6))
        assert stream(parser, prefix, reply, cycle) == whole, sizes
    said = whole[0] + " " + whole[1] + " " + " ".join(c["name"] + " " + c["arguments"] for c in whole[2])
    assert not words(reply, parser.markers) - words(said, parser.markers), "reply text vanished"


def test_random_pieces_of_every_reply_stream_as_the_whole():
    rng = random.Random(0)
    for (reasoning_parser, tool_parser, prefix), (reply, *_) in PARAMS:
        parser = OutputParser(reasoning_parser, tool_parser)
        whole = StreamSplitter(parser, prefix).feed(reply, final=True)
        for _ in range(5):
            assert stream(parser, prefix, reply, iter(lambda: rng.randint(1, 9), None)) == whole


@pytest.fixture(scope="module")
def tokenizer_with_special_markers():
    """A byte-level BPE whose every parser marker is a special token, as in many real tokenizers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["weather in Paris"] * 5, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    markers = sorted({m for key in CASES for m in OutputParser(key[0], key[1]).markers})
    fast.add_special_tokens({"additional_special_tokens": markers})
    return fast


@pytest.mark.parametrize("key", list(CASES), ids=lambda k: k[1] or k[0])
def test_markers_the_tokenizer_marks_special_survive_decoding(tokenizer_with_special_markers, key):
    tok = tokenizer_with_special_markers
    parser = OutputParser(key[0], key[1])
    reply = CASES[key][0][0]
    ids = tok.encode(reply, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) != reply  # what the engine's own decoder would give
    assert keeping_markers(tok, parser.markers)(ids) == reply
