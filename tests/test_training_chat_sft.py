"""Chat SFT examples (tiermoe.training.chat_sft): the chat template's tokens with labels on the replies only
(content + end-of-turn token), found by rendering growing prefixes, on a make-model byte-level tokenizer, the demo
model's tokenizer and a non-ChatML template; truncation, padding, and the seeded batch order."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from tiermoe.data.chat_conversations import chat_conversations
from tiermoe.errors import TiermoeError
from tiermoe.bundled import BUNDLED_MODEL_DIR
from tiermoe.testing.checkpoint_tokenizer import write_tokenizer
from tiermoe.training.chat_sft import IGNORE_INDEX, ChatEncoder, SFTBatches, collate, encode_all

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "Tell me a joke"},
    {"role": "assistant", "content": "No, thanks."},
]
# A non-ChatML template (DeepSeek-like markers, no special tokens: they are plain text to this tokenizer).
MARKER_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<User>{{ m['content'] }}"
                   "{% elif m['role'] == 'assistant' %}<Bot>{{ m['content'] }}<end>{% else %}{{ m['content'] }}\n"
                   "{% endif %}{% endfor %}{% if add_generation_prompt %}<Bot>{% endif %}")


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("byte_tok")
    write_tokenizer("mixtral", None, 300, out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)


def labelled_spans(example) -> list[list[int]]:
    """The runs of consecutive labelled positions, as token ids."""
    spans, current = [], []
    for token, label in zip(example.input_ids, example.labels, strict=True):
        if label == IGNORE_INDEX:
            if current:
                spans.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    return spans + ([current] if current else [])


@pytest.mark.parametrize("which", ["byte", "demo"])
def test_only_the_replies_and_their_end_of_turn_token_are_labelled(which, byte_tokenizer, demo_tokenizer):
    tok = byte_tokenizer if which == "byte" else demo_tokenizer
    example = ChatEncoder(tok, max_length=4096).encode(CONVERSATION)
    assert example.input_ids == tok(tok.apply_chat_template(CONVERSATION, tokenize=False),
                                    add_special_tokens=False)["input_ids"]
    replies = [tok.decode(span) for span in labelled_spans(example)]
    assert replies == ["Hello. How can I help?<|im_end|>", "No, thanks.<|im_end|>"]


def test_any_template_works_without_generation_markers(byte_tokenizer):
    tok = AutoTokenizer.from_pretrained(byte_tokenizer.name_or_path)
    tok.chat_template = MARKER_TEMPLATE
    example = ChatEncoder(tok, max_length=4096).encode(CONVERSATION)
    assert tok.decode(example.input_ids).startswith("Be brief.\n<User>Hi there!<Bot>Hello.")
    # no special token in the reply: the whole rendered turn is the reply, its "<end>" marker included
    assert [tok.decode(s) for s in labelled_spans(example)] == ["Hello. How can I help?<end>", "No, thanks.<end>"]


def test_a_template_that_rewrites_earlier_turns_is_a_one_line_error(byte_tokenizer):
    tok = AutoTokenizer.from_pretrained(byte_tokenizer.name_or_path)
    # numbers each turn from the end: every prefix renders differently
    tok.chat_template = ("{% for m in messages %}{{ messages|length - loop.index0 }}:{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}>{% endif %}")
    with pytest.raises(TiermoeError, match="conversation c7: the chat template does not render"):
        ChatEncoder(tok, max_length=4096).encode(CONVERSATION, "c7")


def test_truncation_keeps_the_first_tokens_and_drops_a_conversation_without_reply_tokens(demo_tokenizer):
    full = ChatEncoder(demo_tokenizer, 4096).encode(CONVERSATION)
    first_reply = full.labels.index(next(label for label in full.labels if label != IGNORE_INDEX))
    cut = ChatEncoder(demo_tokenizer, first_reply + 2).encode(CONVERSATION)
    assert cut.input_ids == full.input_ids[: first_reply + 2]
    assert cut.labels == full.labels[: first_reply + 2] and cut.num_target_tokens == 2
    assert ChatEncoder(demo_tokenizer, first_reply).encode(CONVERSATION) is None
    assert ChatEncoder(demo_tokenizer, 64).encode([{"role": "user", "content": "no reply"}]) is None


def test_collate_pads_on_the_right_with_ignored_labels(demo_tokenizer):
    enc = ChatEncoder(demo_tokenizer, 4096)
    a, b = enc.encode(CONVERSATION), enc.encode(CONVERSATION[1:3])
    batch = collate([a, b], pad_id=0)
    n = len(b.input_ids)
    assert batch["input_ids"].shape == (2, len(a.input_ids))
    assert batch["input_ids"][1, :n].tolist() == b.input_ids and (batch["input_ids"][1, n:] == 0).all()
    assert (batch["labels"][1, n:] == IGNORE_INDEX).all() and batch["labels"][1, :n].tolist() == b.labels
    assert batch["attention_mask"].sum(1).tolist() == [len(a.input_ids), n]


def conversations(count: int) -> list[dict]:
    return [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                         {"role": "assistant", "content": f"answer {i} " * (1 + i % 3)}]}
            for i in range(count)]


def test_batches_follow_a_seeded_order_over_epochs_and_resume_from_their_position(demo_tokenizer):
    convs = conversations(7) + [{"id": "empty", "messages": [{"role": "user", "content": "nothing"}]}]
    enc = ChatEncoder(demo_tokenizer, 64)
    straight = SFTBatches(convs, enc, batch_size=3, seed=5)
    batches = [straight.next_batch() for _ in range(6)]  # 18 examples: past two epochs of 7 usable ones
    seen = [tuple(row[row != 0].tolist()) for b in batches for row in b["input_ids"]]
    usable = {tuple(e.input_ids) for e in encode_all(convs, enc)}
    assert len(usable) == 7 and set(seen[:7]) == usable and set(seen[7:14]) == usable  # each epoch sees all
    assert seen[:7] != seen[7:14]  # a new order each epoch

    resumed = SFTBatches(convs, enc, batch_size=3, seed=5)
    first = SFTBatches(convs, enc, batch_size=3, seed=5)
    for _ in range(2):
        first.next_batch()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for expected in batches[2:]:
        got = resumed.next_batch()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(TiermoeError, match="batch_size 4, this run has 3"):
        resumed.load_state_dict({**first.state_dict(), "batch_size": 4})


def test_batches_say_when_no_conversation_has_a_reply_within_the_cut(demo_tokenizer):
    batches = SFTBatches(conversations(3), ChatEncoder(demo_tokenizer, 4), batch_size=2)
    with pytest.raises(TiermoeError, match="raise --max-length"):
        batches.next_batch()


def test_dataset_files_of_both_shapes(tmp_path):
    path = tmp_path / "chats.jsonl"
    rows = [{"id": "a", "messages": CONVERSATION},
            {"conversations": [{"from": "human", "value": "hey"}, {"from": "gpt", "value": "hi!"}]},
            {"messages": [{"role": "user", "content": "no reply: skipped"}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]},
                          {"role": "assistant", "content": "ok"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    convs = chat_conversations(str(path))
    assert [c["id"] for c in convs] == ["a", "chats.jsonl:1", "chats.jsonl:3"]
    assert convs[1]["messages"] == [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "hi!"}]
    assert convs[2]["messages"][0] == {"role": "user", "content": "parts"}


@pytest.mark.parametrize("record, message", [
    ([1, 2], "line 2: a JSON list is not a record"),
    ({"text": "hello"}, r"line 2: a record with keys \[text\] is not a conversation"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "line 2 message 0: expected"),
    ({"messages": [{"role": "user", "content": 5}]}, "line 2 message 0: expected"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "line 2: ShareGPT turn"),
    ({"conversations": ["hello"]}, "line 2: every ShareGPT turn must be an object"),
])
def test_a_malformed_record_is_a_one_line_error_naming_it(tmp_path, record, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(TiermoeError, match=message) as err:
        chat_conversations(str(path))
    assert "\n" not in str(err.value) and "bad.jsonl" in str(err.value)


def test_unknown_datasets_and_files_without_replies_are_errors(tmp_path):
    with pytest.raises(TiermoeError, match="choose sharegpt or demo"):
        chat_conversations("alpaca")
    path = tmp_path / "none.json"
    path.write_text(json.dumps([{"messages": [{"role": "user", "content": "hi"}]}]))
    with pytest.raises(TiermoeError, match="no conversation with an assistant reply"):
        chat_conversations(str(path))
