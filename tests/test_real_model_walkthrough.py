"""README's "Run a real model" walkthrough, every command of it, on tiny stand-ins: a Hugging Face checkpoint
directory and a GGUF file take the places of /models/Qwen3-30B-A3B and its Q4_K_M GGUF.

The commands are read from the README itself, so the walkthrough cannot drift from what the code does. What the
test changes, and only that: the model paths, `cuda:0` (the GPU tier runs on the CPU device here, as everywhere in
the suite), record's dataset and prompt counts (a two-prompt file), serve's port, and chat's reply length. `serve`
runs for real up to listening (flags, fit check, loading, server state); then, instead of waiting for Ctrl-C, it
listens on a thread long enough to answer one completion and the chat commands that follow it in the README.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import sys
from pathlib import Path

import httpx
import pytest
from conftest import run_cli, save_char_tokenizer, save_tiny
from serve_stub import replace_serve
from server_thread import listening
from test_checkpoint_gguf import write_qwen3moe_gguf

from tiermoe.distributed.launch import free_port
from tiermoe.placement.plan import PlacementPlan
from tiermoe.server.app import create_app

README = Path(__file__).resolve().parent.parent / "README.md"
HF_PATH, GGUF_PATH = "/models/Qwen3-30B-A3B", "/models/Qwen3-30B-A3B-Q4_K_M.gguf"


def walkthrough_blocks() -> list[list[list[str]]]:
    """The README section's code blocks, each a list of command lines (shell words), in order."""
    text = README.read_text()
    section = re.search(r"^## Run a real model\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README has no 'Run a real model' section"
    blocks = re.findall(r"```bash\n(.*?)```", section.group(1), re.S)
    return [[shlex.split(line, comments=True) for line in (raw.strip() for raw in block.splitlines())
             if line and not line.startswith("#")] for block in blocks]


def walkthrough_commands() -> list[list[str]]:
    return [command for block in walkthrough_blocks() for command in block]


def test_the_walkthrough_covers_fit_place_serve_for_both_kinds_and_both_setups():
    commands = walkthrough_commands()
    assert all(c[0] == "tiermoe" for c in commands), commands
    for path in (HF_PATH, GGUF_PATH):
        used = [c[1] for c in commands if path in c]
        assert {"fit", "place", "serve"} <= set(used), (path, used)
        serves = [c for c in commands if c[1] == "serve" and path in c]
        assert any("--gpu-device" in c for c in serves) and any("--gpu-device" not in c for c in serves), serves
    assert any(c[1] == "chat" for c in commands)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    root = tmp_path_factory.mktemp("walkthrough")
    hf = save_tiny("qwen3_moe", root / "Qwen3-30B-A3B")
    save_char_tokenizer(hf)
    gguf = root / "Qwen3-30B-A3B-Q4_K_M.gguf"
    write_qwen3moe_gguf(gguf, vocabulary=True)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Hello there", "What is an ocean?")) + "\n")
    return {HF_PATH: str(hf), GGUF_PATH: str(gguf), "prompts": str(prompts)}


def on_stand_ins(command: list[str], stand_ins: dict, port: int) -> list[str]:
    args = [stand_ins.get(word, word).replace("cuda:0", "cpu") for word in command[1:]]
    if args[0] == "record":
        args[args.index("--dataset") + 1] = stand_ins["prompts"]
        args += ["--num-prompts", "2", "--max-tokens", "2", "--no-progress"]  # the last value of a flag wins
    if args[0] == "serve":
        args += ["--port", str(port)]
    if args[0] == "chat":
        args += ["--url", f"http://127.0.0.1:{port}", "--max-tokens", "3", "--no-save-history"]
    return args


class ListenBriefly:
    """In place of serve_http.serve: listen on a thread, answer one completion and run the chat commands given,
    then stop (what Ctrl-C would do)."""

    def __init__(self, monkeypatch):
        self.chats: list[list[str]] = []
        self.replies: list[dict] = []
        replace_serve(monkeypatch, self)

    def __call__(self, state) -> None:
        with listening(create_app(state), state.config.port) as url:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
            self.replies.append(r.json())
            for chat in self.chats:
                self._chat(chat)

    def _chat(self, args: list[str]) -> None:
        stdin = sys.stdin
        sys.stdin = io.StringIO("Hi\n/quit\n")  # a user typing one message, then leaving
        try:
            r = run_cli(*args)
        finally:
            sys.stdin = stdin
        assert r.returncode == 0 and "assistant>" in r.stdout, (r.stdout, r.stderr)
        self.replies.append({"chat": r.stdout})


@pytest.mark.parametrize("block", range(len(walkthrough_blocks())))
def test_every_walkthrough_command_runs_on_tiny_stand_ins(block, stand_ins, tmp_path, monkeypatch):
    """One README code block after the other (each block stands alone: a plan it serves, it places)."""
    monkeypatch.chdir(tmp_path)  # plan.json, plan.png, stats.pt land here
    listener = ListenBriefly(monkeypatch)
    commands = walkthrough_blocks()[block]
    ran = []
    for i, command in enumerate(commands):
        if command[1] == "chat":
            continue  # run by the serve before it, while it listens
        port = free_port()
        args = on_stand_ins(command, stand_ins, port)
        listener.chats = []
        if args[0] == "serve":
            follow = commands[i + 1:]
            while follow and follow[0][1] == "chat":
                listener.chats.append(on_stand_ins(follow.pop(0), stand_ins, port))
        r = run_cli(*args)
        assert r.returncode == 0, f"{shlex.join(command)}\n{r.stdout}\n{r.stderr}"
        assert "Traceback" not in r.stderr, r.stderr
        ran.append(args[0])
        if args[0] == "fit":
            assert r.stdout.rstrip().endswith("fits"), r.stdout  # the verdict, on the last line
        if args[0] == "place":
            out = Path(args[args.index("--out") + 1])
            assert PlacementPlan.load(out).mask.any(), "a GPU budget places experts on the GPU tier"
        if "--plot" in args:
            assert Path(args[args.index("--plot") + 1]).stat().st_size > 0
        if args[0] == "record":
            assert Path(args[args.index("--out") + 1]).is_file()
    assert len(listener.replies) == ran.count("serve") + sum(c[1] == "chat" for c in commands)
