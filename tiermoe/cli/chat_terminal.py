"""The terminal side of `tiermoe chat`: the `you>` prompt with line editing and history, and Ctrl-C.

Typed at (stdin a terminal), lines are read through the standard `readline` module: arrows, Home/End, Ctrl-R search,
Tab completing the slash commands, and a history of the lines typed kept across chats in
~/.tiermoe/chat_history/readline (the last HISTORY_LINES; not written with --no-save-history). Fed from a pipe,
lines are read as they come, without readline and without the prompt (the chat echoes each message instead).

Ctrl-C stops the reply, not the chat. With a server it interrupts at once: the streaming request is closed, and
the server aborts it. With a model loaded here it sets a flag the generation loop reads between two engine steps,
so the reply ends at the next token: interrupting a step halfway could leave the CPU tier's threads writing into
buffers the next step reuses.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

HISTORY_LINES = 1000  # lines of typed history kept (the file stays a few tens of KB)


class LineInput:
    """Reads the user's lines; `read()` returns None at the end of input (Ctrl-D, or the pipe's end) and lets
    Ctrl-C through as KeyboardInterrupt."""

    def __init__(self, interactive: bool, history_file: Path | None, completions: Iterable[str] = ()):
        self.interactive = interactive
        self.history_file = history_file if interactive else None
        self._readline = None
        if interactive:
            try:  # the standard module: absent on some builds (Windows), where input() still works
                self._readline = importlib.import_module("readline")
            except ImportError:
                pass
        if self._readline is not None:
            self._set_up(sorted(completions))

    def _set_up(self, completions: list[str]) -> None:
        readline = self._readline
        readline.set_history_length(HISTORY_LINES)
        if self.history_file is not None and self.history_file.is_file():
            with contextlib.suppress(OSError):
                readline.read_history_file(self.history_file)

        def complete(text: str, state: int) -> str | None:
            matches = [c for c in completions if c.startswith(text)] if text.startswith("/") else []
            return matches[state] if state < len(matches) else None

        readline.set_completer(complete)
        readline.set_completer_delims(" \t\n")
        readline.parse_and_bind("tab: complete")

    def read(self, prompt: str) -> str | None:
        try:
            return input(prompt if self.interactive else "")
        except EOFError:
            if self.interactive:
                print()  # the end of the `you>` line: what follows starts a line of its own
            return None

    def close(self) -> Path | None:
        """Saves the typed history; returns where (None when not saved)."""
        if self._readline is None or self.history_file is None:
            return None
        try:
            self.history_file.parent.mkdir(parents=True, exist_ok=True)
            self._readline.write_history_file(self.history_file)
        except OSError as err:
            print(f"warning: cannot save the typed history to {self.history_file}: {err.strerror}", file=sys.stderr)
            return None
        return self.history_file


@contextlib.contextmanager
def ctrl_c_sets(stop: threading.Event):
    """Within the block, Ctrl-C sets `stop` instead of raising KeyboardInterrupt (the main thread only: signals
    reach no other)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
