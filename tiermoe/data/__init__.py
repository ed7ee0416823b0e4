"""Offline datasets for demos, benchmarks and tests (import-light: no torch, no data loaded at import)."""

from tiermoe.data.sharegpt import (
    first_prompts,
    iter_complete_objects,
    load_sharegpt,
    parse_truncated_json_array,
    to_messages,
)

__all__ = [
    "first_prompts",
    "iter_complete_objects",
    "load_sharegpt",
    "parse_truncated_json_array",
    "to_messages",
]
