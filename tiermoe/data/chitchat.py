"""Open-domain small talk from the `chitchat-dataset` package (7,168 human-human conversations, MIT).

`chitchat_dataset/dataset.json` maps a conversation id to {"messages": [[{"text", "sender", "timestamp"}, ...],
...]}, one inner list per run of messages by one sender. The prompt is the first run's text (its messages joined
by newlines), as a user turn; the conversation id is the held-out group.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiermoe.data.prompts import Prompt, chat_prompt
from tiermoe.errors import TiermoeError


def chitchat_prompts() -> list[Prompt]:
    try:
        import chitchat_dataset
    except ImportError:
        raise TiermoeError("the chitchat dataset needs the `chitchat-dataset` package "
                           "(pip install chitchat-dataset)") from None
    data = json.loads(Path(chitchat_dataset.__file__).with_name("dataset.json").read_text(encoding="utf-8"))
    prompts = []
    for conv_id in sorted(data):
        runs = [run for run in data[conv_id].get("messages") or [] if run]
        if not runs:
            continue
        text = "\n".join(str(m.get("text", "")).strip() for m in runs[0] if str(m.get("text", "")).strip())
        prompt = chat_prompt(f"chitchat-{conv_id}", [("user", text)], group=conv_id)
        if prompt is not None:
            prompts.append(prompt)
    return prompts
