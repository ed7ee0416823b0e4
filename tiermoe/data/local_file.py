"""Prompts from a local `.json` (an array of records) or `.jsonl` (one record a line) file.

A record is one of:
- ShareGPT: {"id"?, "conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]}: the first user turn
  (with any system turn before it) is the prompt, as SGLang's bench_serving takes it;
- OpenAI chat request: {"messages": [{"role", "content"}, ...]}: the request as given, cut after its last user
  turn (`content` may also be a list of {"type": "text", "text"} parts);
- completion prompt: {"prompt": str}, fed as plain text.
Records without a usable user turn are skipped; a file that does not parse, or a record of another shape, is a
TiermoeError naming the file and the line (or array index).
"""

from __future__ import annotations

import json
from pathlib import Path

from tiermoe.data.prompts import Prompt, chat_prompt
from tiermoe.data.sharegpt import conversation_group, sharegpt_prompt
from tiermoe.errors import TiermoeError

SHAPES = 'ShareGPT {"conversations": [...]}, OpenAI {"messages": [...]}, or {"prompt": "..."}'


def read_records(path: Path) -> list[tuple[str, object]]:
    """[(where, record)] of a .json or .jsonl file; `where` is "line N" or "item N" for error messages."""
    if not path.is_file():
        raise TiermoeError(f"dataset file '{path}' does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TiermoeError(f"cannot read dataset file '{path}': {err}") from None
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise TiermoeError(f"dataset file '{path}' line {number} is not valid JSON: {err.msg} "
                                   f"(column {err.colno})") from None
        return records
    if path.suffix != ".json":
        raise TiermoeError(f"dataset file '{path}' must end in .json (an array of records) or .jsonl (one a line)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise TiermoeError(f"dataset file '{path}' is not valid JSON: {err.msg} at line {err.lineno} column "
                           f"{err.colno}") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise TiermoeError(f"dataset file '{path}' holds a JSON {type(data).__name__}; expected an array of records")
    return [(f"item {i}", record) for i, record in enumerate(data)]


def record_to_prompt(record, prompt_id: str, source: str) -> Prompt | None:
    """One record (see the module docstring) as a Prompt; None when it has no usable user turn."""
    if isinstance(record, dict):
        prompt_id = str(record.get("id", prompt_id))
        if isinstance(record.get("conversations"), list):
            return sharegpt_prompt(record, prompt_id, conversation_group(prompt_id))
        if isinstance(record.get("messages"), list):
            return openai_prompt(record["messages"], prompt_id, source)
        if isinstance(record.get("prompt"), str):
            return Prompt(prompt_id, text=record["prompt"]) if record["prompt"].strip() else None
        keys = ", ".join(map(str, list(record)[:6]))
        raise TiermoeError(f"{source}: a record with keys [{keys}] is none of the supported shapes: {SHAPES}")
    raise TiermoeError(f"{source}: a JSON {type(record).__name__} is not a record; expected one of: {SHAPES}")


def openai_prompt(messages: list, prompt_id: str, source: str) -> Prompt | None:
    pairs = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TiermoeError(f"{source}: a message must be an object with a 'role' and a 'content'")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(content, str):
            content = ""
        pairs.append((m["role"], content))
    return chat_prompt(prompt_id, pairs)


def file_prompts(path: str | Path) -> list[Prompt]:
    """All usable prompts of a local .json / .jsonl dataset file, in file order."""
    path = Path(path)
    prompts = []
    for i, (where, record) in enumerate(read_records(path)):
        prompt = record_to_prompt(record, f"{path.name}:{i}", f"dataset file '{path}' {where}")
        if prompt is not None:
            prompts.append(prompt)
    if not prompts:
        raise TiermoeError(f"dataset file '{path}' has no usable prompt (records: {SHAPES})")
    return prompts
