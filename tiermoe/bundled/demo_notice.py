"""One line on stderr, once per command, whenever the bundled demo model stands in for a `--model` not given.

The demo model is a toy whose replies read as nonsense; a newcomer who never passed --model would otherwise take
that for a broken engine. Commands resolve the default model several times (flags, fit check, the LLM itself), so
the line is said by the first resolution inside a scope and not again: `run_as_command` opens the scope around
each command. The scope lives in a ContextVar, not a module flag, so two commands run in one process (tests, a
library embedding the CLI) each say it once, and library calls outside any command (`tiermoe.LLM()`) stay silent.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

DEMO_MODEL_NOTICE = (
    "the bundled demo model: 12M parameters trained for under an hour on two CPU cores; replies are not meant to "
    "make sense; run a real model: see README 'Run a real model'"
)


class _Notice:
    """Whether this command has said the line yet."""

    def __init__(self) -> None:
        self.said = False


_CURRENT: ContextVar[_Notice | None] = ContextVar("tiermoe_demo_model_notice", default=None)


@contextmanager
def demo_model_notice() -> Iterator[None]:
    """Within this scope the first use of the bundled model prints DEMO_MODEL_NOTICE on stderr; later ones don't."""
    token = _CURRENT.set(_Notice())
    try:
        yield
    finally:
        _CURRENT.reset(token)


def say_demo_model_notice() -> None:
    """Print the notice if a command's scope is open and has not printed it yet (sys.stderr as it is now, so a
    redirected stderr gets it)."""
    notice = _CURRENT.get()
    if notice is None or notice.said:
        return
    notice.said = True
    print(DEMO_MODEL_NOTICE, file=sys.stderr, flush=True)
