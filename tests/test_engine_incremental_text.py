"""Per-step text work does not grow with the output (issue: serving under hostile load, class 2): each step hands
the detokeniser a few ids and searches a few characters for stop strings, at 40 output tokens as at 4,000, and the
streamed text is the whole output's decode, multi-byte characters split over byte tokens included."""

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


def run_steps(tok: Tokenizer, ids: list[int], monkeypatch) -> tuple[list[int], list[int], str]:
    """The engine's stop check and a stream, one token a step: (ids decoded per step, characters searched per
    step, the streamed text)."""
    handed, scanned = [0], [0]

    def detokenize(window):
        handed[0] += len(window)
        return tok.decode(window)

    def counted_find_stop(text, new, stops):
        scanned[0] += min(len(text), new + max(len(s) for s in stops) - 1)
        return find_stop(text, new, stops)

    monkeypatch.setattr(engine_module, "find_stop", counted_find_stop)
    engine = SimpleNamespace(eos_token_ids=set(), max_context=None, detokenize=detokenize)
    engine.decoded_text = lambda seq: Engine.decoded_text(engine, seq)
    seq = Sequence(0, [1], SamplingParams(max_tokens=10 ** 6, stop=STOPS), generator=None)
    stream = TextStream(engine.decoded_text(seq), STOPS)
    decoded, searched, out = [], [], []
    for token in ids:
        seq.output_ids.append(token)
        handed[0] = scanned[0] = 0
        Engine._check_stop(engine, seq)
        out.append(stream.delta(seq.output_ids, finished=False))
        decoded.append(handed[0])
        searched.append(scanned[0])
    assert not seq.finished
    out.append(stream.delta(seq.output_ids, finished=True))
    return decoded, searched, "".join(out)


@pytest.mark.parametrize("length", [40, 4000])
def test_each_step_decodes_and_searches_a_bounded_window_and_streams_the_whole_text(byte_bpe, length, monkeypatch):
    ids = byte_bpe.encode(TEXT * (length // 20)).ids[:length]
    assert len(ids) == length
    decoded, searched, text = run_steps(byte_bpe, ids, monkeypatch)
    assert text == byte_bpe.decode(ids)
    # a window of a few ids, twice (what it counted, and all of it), an incomplete character's ids at most besides
    assert max(decoded) <= 4 * MAX_PENDING, max(decoded)
    assert max(searched) <= 64, max(searched)  # the new characters and the longest stop string's length


def test_a_stop_string_split_over_steps_is_found_where_it_starts():
    inc = IncrementalText(lambda ids: "".join(chr(i) for i in ids))
    stops = ("STOP", "xy")
    ids, found = [], None
    for ch in "abcST" + "OPdef":
        ids.append(ord(ch))
        added = inc.update(ids)
        found = found or find_stop(inc.text, len(added), stops)
    assert found == (3, "STOP") and inc.text[:found[0]] == "abc"
