"""Where `tiermoe generate` takes its prompt from, in the ways llama.cpp and Ollama users type one: the words after
the command, `-p/--prompt TEXT`, or standard input when neither is given and it is not a terminal
(`echo hi | tiermoe generate`, `tiermoe generate < question.txt`).

A terminal on stdin is never read: a user who forgot the prompt gets an error at once rather than a silent wait.
A pipe is read up to MAX_PROMPT_CHARS, so `yes | tiermoe generate` ends with an error instead of filling memory.
"""

from __future__ import annotations

from typing import TextIO

from tiermoe.errors import TiermoeError

MAX_PROMPT_CHARS = 16 * 2**20  # far beyond any model's context, small enough to hold


def prompt_from(words: list[str], flag: str | None, stdin: TextIO | None) -> str:
    """The prompt: `words` joined by spaces, else `flag`, else what `stdin` holds when it is a pipe or a file."""
    if words and flag is not None:
        raise TiermoeError("the prompt is given twice (as words after the command and with --prompt); give one")
    if words:
        return " ".join(words)
    if flag is not None:
        return flag
    text = _piped_text(stdin)
    if text:
        return text
    raise TiermoeError('no prompt: give it after the command (tiermoe generate "Hello"), with -p/--prompt, or on '
                       "stdin (echo Hello | tiermoe generate)")


def _piped_text(stdin: TextIO | None) -> str:
    """What a pipe or file on stdin holds (without the final newline), or "" for a terminal, nothing, or no stdin."""
    try:
        if stdin is None or stdin.isatty():
            return ""
        text = stdin.read(MAX_PROMPT_CHARS + 1)
    except (OSError, ValueError):  # closed, or a stand-in that cannot be read (a test harness's)
        return ""
    if len(text) > MAX_PROMPT_CHARS:
        raise TiermoeError(f"the prompt on stdin is longer than {MAX_PROMPT_CHARS:,} characters; expected a prompt "
                           "that fits in a model's context")
    return text.rstrip("\n") if text.strip() else ""
