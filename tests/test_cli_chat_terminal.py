"""`tiermoe chat` typed at in a terminal (a pseudo-terminal that is the chat's controlling terminal, so a typed Ctrl-C
is the SIGINT a user's is): a line edited with the Left arrow reaches the model as edited, Ctrl-C during a reply
stops it and the server aborts the request, Ctrl-C at the prompt says how to leave, and Ctrl-D leaves with status 0
and the history line on a line of its own."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from fcntl import ioctl
from pathlib import Path

from server_thread import server_thread

from tiermoe.cli.chat_cmd import LEAVE_HINT

LEFT, CTRL_C, CTRL_D = "\x1b[D", "\x03", "\x04"
ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|[=>])|\r")  # what readline writes to move about and set modes
# setsid, then open the pty: it becomes the controlling terminal (Ctrl-C typed is SIGINT), on stdin/out/err. SIGINT
# as a shell starts a command: default and unblocked (an ignored or blocked SIGINT is inherited across exec, and a
# test runner's worker process may have either)
ON_ITS_OWN_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                       "os.setsid(); fd = os.open(sys.argv[1], os.O_RDWR); "
                       "[os.dup2(fd, i) for i in range(3)]; os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


class Terminal:
    """A command on a pseudo-terminal: `send` types, `expect` waits for text on the screen."""

    def __init__(self, argv: list[str], env: dict):
        self.master, slave = os.openpty()
        ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))
        self.process = subprocess.Popen([sys.executable, "-c", ON_ITS_OWN_TERMINAL, os.ttyname(slave), *argv], env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        os.close(slave)
        self.screen = ""
        self.seen = 0  # how far expect() has read

    def read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if ready:
            try:
                self.screen += os.read(self.master, 65536).decode(errors="replace")
            except OSError:  # the command has exited and closed the terminal
                time.sleep(timeout)

    def expect(self, text: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.screen[self.seen:]:
            assert time.monotonic() < deadline, f"{text!r} not shown; the screen: {self.screen!r}"
            self.read(0.1)
        self.seen = self.screen.index(text, self.seen) + len(text)

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def wait(self, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            self.read(0.1)
        self.read(0.1)
        return self.process.wait(timeout=1)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        os.close(self.master)


def until(condition, terminal: Terminal, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out; the screen: {terminal.screen!r}"
        terminal.read(0.02)


def test_a_typed_chat_edits_lines_stops_a_reply_and_leaves_on_ctrl_d(tmp_path):
    with server_thread(tmp_path / "server", step_sleep=0.05) as (url, state):
        state.llm.engine.eos_token_ids = frozenset()  # replies run to --max-tokens: long enough to stop one
        conversations = []
        chat_prompt_ids = state.llm.chat_prompt_ids

        def recording(messages, *args, **kwargs):
            conversations.append([m["content"] for m in messages])
            return chat_prompt_ids(messages, *args, **kwargs)

        state.llm.chat_prompt_ids = recording
        env = dict(os.environ, HOME=str(tmp_path), TERM="xterm", INPUTRC=os.devnull)
        terminal = Terminal(["-m", "tiermoe.cli.main", "chat", "--url", url, "-t", "0", "--max-tokens", "200"], env)
        try:
            terminal.expect("chatting with tiny")
            terminal.expect("you> ")
            terminal.send("wrld" + LEFT * 3 + "o\r")  # "w|rld": "o" lands after the "w"
            terminal.expect("assistant> ")
            until(lambda: state.metrics.generation_tokens >= 3, terminal)  # the reply is under way
            terminal.send(CTRL_C)
            terminal.expect("(reply stopped")
            terminal.expect("you> ")
            until(lambda: state.metrics.requests_aborted == 1, terminal)  # the server saw the stream closed
            assert state.service.running == 0 and state.metrics.generation_tokens < 200
            assert conversations == [["world"]]  # the edited line, not "wrld" with an escape sequence in it

            terminal.send(CTRL_C)  # at the prompt: nothing to stop
            terminal.expect(LEAVE_HINT)
            terminal.expect("you> ")
            terminal.send(CTRL_D)
            assert terminal.wait() == 0
        finally:
            terminal.close()
    lines = [ESCAPES.sub("", line) for line in terminal.screen.split("\n")]
    [saved_line] = [line for line in lines if "history saved to" in line]
    history = tmp_path / ".tiermoe" / "chat_history"
    [conversation] = history.glob("chat_*.json")
    assert saved_line == f"history saved to {conversation}"  # on its own line, not after `you>`
    messages = json.loads(conversation.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "world"
    assert "world" in Path(history / "readline").read_text().splitlines()
