"""`tiermoe chat --local`: Ctrl-C stops the reply at the next token (a flag the generation loop reads between engine
steps, never an interrupted step), the part shown stays in the conversation and the chat goes on; --verbose prints
each reply's speed."""

from __future__ import annotations

import io
import json
import re
import signal
import threading

import pytest
from conftest import run_cli, save_char_tokenizer, save_tiny

from tiermoe.cli import chat_local
from tiermoe.cli.chat_terminal import ctrl_c_sets


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("chat-local"))
    save_char_tokenizer(path)
    return path


class ChattyLLM(chat_local.LLM):
    """The LLM, with replies that run to --max-tokens and a Ctrl-C after the 3rd engine step of the first reply."""

    steps = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine.eos_token_ids = frozenset()
        self.engine.after_step_hooks.append(self._count)

    def _count(self) -> None:
        ChattyLLM.steps += 1
        if ChattyLLM.steps == 3:
            signal.raise_signal(signal.SIGINT)  # as a Ctrl-C typed while the model generates


def test_ctrl_c_stops_a_local_reply_at_the_next_token_and_the_chat_goes_on(model_dir, monkeypatch, tmp_path):
    monkeypatch.setattr(chat_local, "LLM", ChattyLLM)
    monkeypatch.setattr(ChattyLLM, "steps", 0)
    monkeypatch.setattr("sys.stdin", io.StringIO("first\nsecond\n"))
    history = tmp_path / "talk.json"
    result = run_cli("chat", "--local", str(model_dir), "-t", "0", "--max-tokens", "20", "--history-file",
                     str(history), "--verbose")
    assert result.returncode == 0, result.stderr
    assert ChattyLLM.steps == 3 + 20  # the first reply stopped after its 3rd step; the second ran to the end
    assert result.stdout.count("(reply stopped") == 1
    messages = json.loads(history.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in messages[::2]] == ["first", "second"]
    assert len(messages[1]["content"]) <= 3  # the part shown: a character a token at most
    # --verbose: the speed of the reply that ran to its end (a stopped one gets none): 19 tokens after the first
    [speed] = [line for line in result.stderr.splitlines() if line.startswith("prompt ")]
    assert re.fullmatch(r"prompt \d+ tokens, first token \d+\.\d\d s, decode 19 tokens at \d+\.\d tok/s", speed)


def test_within_the_reply_ctrl_c_sets_the_stop_flag_instead_of_raising():
    stop = threading.Event()
    # Python's own handler first, unblocked, as in a terminal (a test runner's worker may have set another)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        with ctrl_c_sets(stop):
            signal.raise_signal(signal.SIGINT)
        assert stop.is_set()
        with pytest.raises(KeyboardInterrupt):  # outside it, Ctrl-C is Python's again
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, outer)
