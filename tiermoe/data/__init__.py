"""Offline prompt datasets for recording statistics, demos, benchmarks and tests.

Import-light: no torch, and no data loaded or data package imported at import time.
- prompts.py: the Prompt type; length filter, held-out split and seeded sampling (`select`).
- registry.py: `load_prompts(name_or_file)`: sharegpt, gsm8k, gpqa, chitchat, or a local .json/.jsonl file.
- sharegpt.py, infra_bench.py, chitchat.py, local_file.py: one loader each.
- demo_split.py: the bundled demo model's conversations and its train / held-out split (fine-tuning measures
  itself on that held-out split; scripts/train_demo_model.py made it).
"""

from tiermoe.data.prompts import Prompt, filter_by_length, select, shuffled, split
from tiermoe.data.registry import DATASETS, load_prompts
from tiermoe.data.sharegpt import (
    first_prompts,
    iter_complete_objects,
    load_sharegpt,
    parse_truncated_json_array,
    sharegpt_prompts,
    to_messages,
)

__all__ = [
    "DATASETS",
    "Prompt",
    "filter_by_length",
    "first_prompts",
    "iter_complete_objects",
    "load_prompts",
    "load_sharegpt",
    "parse_truncated_json_array",
    "select",
    "sharegpt_prompts",
    "shuffled",
    "split",
    "to_messages",
]
