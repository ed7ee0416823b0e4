"""Per-step text work does not grow with the output (issue: serving under hostile load, class 2): each step hands
the detokeniser a few ids, searches a few characters for stop strings and has the reasoning and tool-call parsers
scan a few characters, at 40 output tokens as at 4,000, and the streamed text is the whole output's decode,
multi-byte characters split over byte tokens included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tiermoe.engine import engine as engine_module
from tiermoe.engine.engine import Engine
from tiermoe.engine.incremental_text import MAX_PENDING, IncrementalText, find_stop
from tiermoe.engine.sampling import SamplingParams
from tiermoe.engine.sequence import Sequence
from tiermoe.engine.text_stream import TextStream
from tiermoe.server import marker_scan
from tiermoe.server.output_parsers import OutputParser, StreamSplitter

TEXT = ("The naïve café served crème brûlée; 日本語のテキスト and emoji 🙂🚀 between words. "
        "Ölçüm, ağaç, Größe: every script at once.\n")
STOPS = ("<<never>>", "\n\n\n\n")


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    """A small byte-level BPE: characters outside its merges come out as single bytes (U+FFFD alone)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT[:60]] * 20, trainer)
    return tok


def run_steps(tok: Tokenizer, ids: list[int], monkeypatch, splitter: StreamSplitter | None = None):
    """The engine's stop check and a stream, one token a step, its deltas fed to `splitter`: (ids decoded per step,
    characters searched for stop strings per step, characters the parsers scanned per step, the streamed text, the
    splitter's (reasoning, content, calls) all told)."""
    handed, scanned, parsed = [0], [0], [0]

    def detokenize(window):
        handed[0] += len(window)
        return tok.decode(window)

    def counted_find_stop(text, new, stops):
        scanned[0] += min(len(text), new + max(len(s) for s in stops) - 1)
        return find_stop(text, new, stops)

    def counted_find_marker(text, markers):
        parsed[0] += len(text)
        return find_marker(text, markers)

    find_marker = marker_scan.find_marker
    monkeypatch.setattr(engine_module, "find_stop", counted_find_stop)
    monkeypatch.setattr(marker_scan, "find_marker", counted_find_marker)
    engine = SimpleNamespace(eos_token_ids=set(), max_context=None, detokenize=detokenize)
    engine.decoded_text = lambda seq: Engine.decoded_text(engine, seq)
    seq = Sequence(0, [1], SamplingParams(max_tokens=10 ** 6, stop=STOPS), generator=None)
    stream = TextStream(engine.decoded_text(seq), STOPS)
    decoded, searched, scanned_by_parsers, out, split = [], [], [], [], [[], [], []]

    def send(delta: str, final: bool) -> None:
        out.append(delta)
        for part, got in zip(split, splitter.feed(delta, final) if splitter else ()):
            part.append(got)

    for token in ids:
        seq.output_ids.append(token)
        handed[0] = scanned[0] = parsed[0] = 0
        Engine._check_stop(engine, seq)
        send(stream.delta(seq.output_ids, finished=False), final=False)
        decoded.append(handed[0])
        searched.append(scanned[0])
        scanned_by_parsers.append(parsed[0])
    assert not seq.finished
    send(stream.delta(seq.output_ids, finished=True), final=True)
    parts = ("".join(split[0]), "".join(split[1]), [call for calls in split[2] for call in calls])
    return decoded, searched, scanned_by_parsers, "".join(out), parts


@pytest.mark.parametrize("length", [40, 4000])
def test_each_step_decodes_and_searches_a_bounded_window_and_streams_the_whole_text(byte_bpe, length, monkeypatch):
    ids = byte_bpe.encode(TEXT * (length // 20)).ids[:length]
    assert len(ids) == length
    decoded, searched, _, text, _ = run_steps(byte_bpe, ids, monkeypatch)
    assert text == byte_bpe.decode(ids)
    # a window of a few ids, twice (what it counted, and all of it), an incomplete character's ids at most besides
    assert max(decoded) <= 4 * MAX_PENDING, max(decoded)
    assert max(searched) <= 64, max(searched)  # the new characters and the longest stop string's length


@pytest.mark.parametrize("length", [40, 4000])
def test_the_reasoning_and_tool_call_parsers_scan_a_bounded_window_per_step(byte_bpe, length, monkeypatch):
    """A reply that thinks for half its length, answers for the other half and ends in a tool call, streamed
    through the qwen3 reasoning and qwen25 tool-call parsers beside two stop strings."""
    body = (TEXT * (length // 20 + 1))[:length * 2]  # ~2 characters a token: well over `length` tokens in all
    reply = f"<think>{body[:len(body) // 2]}</think>\n\n{body[len(body) // 2:]}<tool_call>" \
            '{"name": "f", "arguments": {"x": 1}}</tool_call>'
    ids = byte_bpe.encode(reply).ids
    splitter = StreamSplitter(OutputParser("qwen3", "qwen25"))
    decoded, searched, parsed, text, (reasoning, content, calls) = run_steps(byte_bpe, ids, monkeypatch, splitter)
    assert text == reply
    assert (reasoning, content) == (body[:len(body) // 2], body[len(body) // 2:].rstrip())
    assert calls == [{"name": "f", "arguments": '{"x": 1}'}]
    assert max(decoded) <= 4 * MAX_PENDING and max(searched) <= 64, (max(decoded), max(searched))
    # a step's new characters and a held tail shorter than the longest marker
    assert max(parsed) <= 48, max(parsed)


def test_a_stop_string_split_over_steps_is_found_where_it_starts():
    inc = IncrementalText(lambda ids: "".join(chr(i) for i in ids))
    stops = ("STOP", "xy")
    ids, found = [], None
    for ch in "abcST" + "OPdef":
        ids.append(ord(ch))
        added = inc.update(ids)
        found = found or find_stop(inc.text, len(added), stops)
    assert found == (3, "STOP") and inc.text[:found[0]] == "abc"
