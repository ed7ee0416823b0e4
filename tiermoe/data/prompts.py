"""Prompts as the recorder feeds them, and how a set of them is chosen: length filter, held-out split, sampling.

A Prompt is either a chat request (`messages`: (role, content) pairs ending with a user turn; the chat template
is applied when the tokenizer has one) or a plain completion prompt (`text`, fed as is). Pure functions, no
state: the same dataset, seed and settings always give the same prompts in the same order.

The held-out split hashes each prompt's group (a conversation's id; the parts "abc_0", "abc_1" of one ShareGPT
conversation share the group "abc") with the seed, so a prompt's side does not depend on which other prompts
were loaded or sampled: statistics recorded on `train` can be evaluated on `heldout` without overlap.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from dataclasses import dataclass

SPLITS = ("all", "train", "heldout")


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: tuple[tuple[str, str], ...] = ()  # (role, content), the last one a user turn
    text: str | None = None  # plain completion prompt: no chat template
    group: str | None = None  # prompts of one group land on the same side of the held-out split

    def __post_init__(self):
        if (self.text is None) == (not self.messages):
            raise ValueError("a Prompt has either messages or text")

    @property
    def is_chat(self) -> bool:
        return self.text is None

    def chat_messages(self) -> list[dict[str, str]]:
        """The request as chat-template input: [{"role", "content"}, ...]."""
        return [{"role": role, "content": content} for role, content in self.messages]

    def plain_text(self) -> str:
        """The prompt for a model without a chat template: the text, or the messages' contents joined."""
        return self.text if self.text is not None else "\n\n".join(content for _, content in self.messages)

    @property
    def num_chars(self) -> int:
        return len(self.text) if self.text is not None else sum(len(c) for _, c in self.messages)


def chat_prompt(prompt_id: str, messages: Iterable[tuple[str, str]], group: str | None = None) -> Prompt | None:
    """A chat Prompt from (role, content) pairs cut after their last user turn; None if there is no non-empty one."""
    messages = list(messages)
    last_user = max((i for i, (role, c) in enumerate(messages) if role == "user" and c.strip()), default=None)
    if last_user is None:
        return None
    return Prompt(prompt_id, tuple(messages[:last_user + 1]), group=group)


def filter_by_length(prompts: Iterable[Prompt], min_chars: int = 1, max_chars: int | None = None) -> list[Prompt]:
    """Prompts whose total characters are within [min_chars, max_chars] (max None: no upper limit)."""
    return [p for p in prompts if p.num_chars >= min_chars and (max_chars is None or p.num_chars <= max_chars)]


def in_heldout(prompt: Prompt, fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{prompt.group or prompt.id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split(prompts: Iterable[Prompt], part: str = "all", heldout_fraction: float = 0.1, seed: int = 0) -> list[Prompt]:
    """The `train` part, the `heldout` part (about `heldout_fraction` of the groups), or `all` prompts."""
    if part not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {part!r}")
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    if part == "all":
        return list(prompts)
    want_heldout = part == "heldout"
    return [p for p in prompts if in_heldout(p, heldout_fraction, seed) == want_heldout]


def shuffled(prompts: Iterable[Prompt], seed: int = 0) -> list[Prompt]:
    """All prompts in a seeded random order (a sample of n is the first n of them)."""
    out = list(prompts)
    random.Random(seed).shuffle(out)
    return out


def select(prompts: Iterable[Prompt], num: int | None = None, seed: int = 0, min_chars: int = 1,
           max_chars: int | None = None, part: str = "all", heldout_fraction: float = 0.1) -> list[Prompt]:
    """Length filter, then the split, then a seeded sample of `num` (None: all of them, shuffled)."""
    chosen = shuffled(split(filter_by_length(prompts, min_chars, max_chars), part, heldout_fraction, seed), seed)
    return chosen if num is None else chosen[:num]
