"""Fields of the OpenAI and Ollama APIs that this server does not implement: accepted at their neutral value (what
clients send when they do not use the feature: `tools: []`, `best_of: 1`, `frequency_penalty: 0`), refused with a
400 that says so otherwise. Ignoring them would pretend: a client asking for JSON output or a penalty would get an
answer made without it and no sign of that.

    best_of: Annotated[int | None, only(None, 1)] = None
"""

from __future__ import annotations

import json

from pydantic import AfterValidator

UNSUPPORTED = "is not supported by this server"


def only(*neutral) -> AfterValidator:
    """A validator that lets through the `neutral` values only (compared by JSON value, so 1 is not True)."""
    accepted = [json.dumps(v, sort_keys=True) for v in neutral]

    def check(value):
        if _json(value) in accepted:
            return value
        raise ValueError(f"{UNSUPPORTED}; accepted: {', '.join(accepted)}")

    check.neutral = tuple(accepted)  # what docs/server-api.md lists (tiermoe.server.request_options_table)
    return AfterValidator(check)


def neutral_values(validator) -> tuple[str, ...] | None:
    """The values (as JSON) a field annotated with only(...) accepts; None for any other validator."""
    return getattr(getattr(validator, "func", None), "neutral", None)


def _json(value) -> str:
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_unset=True)
    return json.dumps(value, sort_keys=True)
