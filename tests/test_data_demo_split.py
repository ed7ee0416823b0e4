"""The demo model's train / held-out split (tiermoe.data.demo_split): the pure steps on small inputs, and (slow)
the bundled model card's figures reproduced from the data packages."""

from __future__ import annotations

import re

import pytest

from tiermoe.data.demo_split import (
    FUNCTION_WORDS,
    cut_to_tokens,
    demo_conversations,
    demo_token_counter,
    is_english_prose,
    render_turn,
    split_conversations,
    turns_that_fit,
)
from tiermoe.errors import TiermoeError


def conv(cid: str, *contents: str, group: str | None = None) -> dict:
    roles = ("user", "assistant")
    return {"id": cid, "group": group or cid, "source": "test",
            "messages": [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]}


def reference_is_english(text: str) -> bool:
    """The training script's original filter, character by character."""
    letters = [ch for ch in text if ch.isalpha()]
    if not letters or sum(ch.isascii() for ch in letters) < 0.97 * len(letters):
        return False
    words = re.findall(r"[a-zA-Z']+", text.lower())
    return sum(w in FUNCTION_WORDS for w in words) >= 0.15 * max(1, len(words))


@pytest.mark.parametrize("text", [
    "what is the best way to do this", "x = f(y) + g(z)", "1234 5678", "", "Was ist das? Ich weiß es nicht",
    "the café is on the corner and it is nice" * 3, "the cat ² and the ½ dog is here", "这是 the 中文 text of it",
    "the 100 ÅÅÅ of a and the" + " word" * 30, "it is é" + " the" * 40,
])
def test_english_filter_is_the_original_one(text):
    assert is_english_prose(text) == reference_is_english(text)


def test_split_keeps_groups_together_and_drops_training_copies_of_held_out_prompts():
    convs = [conv(f"g{g}_{p}", f"prompt {g} {p}", "reply", group=f"g{g}") for g in range(20) for p in range(3)]
    convs.append(conv("copy", "prompt 0 0", "another reply", group="copy-group"))  # same first prompt as g0_0
    train, held = split_conversations(convs, n_heldout=7, seed=0)
    held_groups = {c["group"] for c in held}
    assert len(held) == 9  # whole groups of three until at least 7
    assert not held_groups & {c["group"] for c in train}
    held_prompts = {c["messages"][0]["content"] for c in held}
    assert not held_prompts & {c["messages"][0]["content"] for c in train}
    assert ("copy" in {c["id"] for c in train}) == ("g0" not in held_groups)
    assert split_conversations(convs, 7, seed=0) == (train, held)  # seeded
    assert split_conversations(convs, 7, seed=1)[1] != held


def test_turns_that_fit_counts_the_closing_token_and_needs_a_first_exchange():
    assert turns_that_fit([3, 4, 5], 13) == 3  # 1 + 3 + 4 + 5 = 13
    assert turns_that_fit([3, 4, 5], 12) == 2
    assert turns_that_fit([3, 4, 5], 8) == 2
    assert turns_that_fit([3, 4, 5], 7) == 0  # only the user turn fits
    assert turns_that_fit([3, 4, 6, 1], 10) == 2  # stops at the first turn that overflows


def test_cut_to_tokens_equals_cutting_each_conversation_alone():
    words = "the quick brown fox jumps over a lazy dog again".split()
    convs = [conv(f"c{i}", *(" ".join(words[: 1 + (i * 7 + t * 3) % 10]) * (1 + (i + t) % 4) for t in range(2 + i % 5)))
             for i in range(40)]
    count = demo_token_counter()
    for max_tokens in (30, 60, 200, 100_000):
        expected = []
        for c in convs:
            kept = turns_that_fit(count([render_turn(m) for m in c["messages"]]), max_tokens)
            if kept:
                expected.append({**c, "messages": c["messages"][:kept]})
        assert cut_to_tokens(convs, count, max_tokens) == expected


def test_an_unknown_split_is_a_one_line_error():
    with pytest.raises(TiermoeError, match="train, heldout"):
        demo_conversations("validation")


@pytest.mark.slow
def test_the_split_reproduces_the_model_card():
    """tiermoe/bundled/tiermoe-demo/README.md: 194 ShareGPT + 100 Chit-Chat held-out conversations (the first ones
    HqVGK3f_0, DjOoZTB_0), 8,131 + 3,065 training ones of 5,330,358 + 1,611,662 tokens."""
    held = demo_conversations("heldout")
    assert [sum(c["source"] == s for c in held) for s in ("sharegpt", "chitchat")] == [194, 100]
    assert [c["id"] for c in held[:2]] == ["HqVGK3f_0", "DjOoZTB_0"]
    train = demo_conversations("train")
    count = demo_token_counter()
    for source, n, tokens in (("sharegpt", 8131, 5_330_358), ("chitchat", 3065, 1_611_662)):
        part = [c for c in train if c["source"] == source]
        assert len(part) == n
        assert sum(sum(count([render_turn(m) for m in c["messages"]])) + 1 for c in part) == tokens
