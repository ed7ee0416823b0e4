"""tiermoe chat: `kt chat`'s terminal chat (same flags and defaults): a running server at 127.0.0.1:30000 unless
told otherwise, or a model loaded in this process with --local.

Chatting with a server needs nothing heavy (tiermoe.cli.chat_backends: httpx), so it starts at once; the local
backend, which loads torch and transformers, is imported only with --local. Ctrl-C stops a reply and keeps the chat:
the part of the reply shown so far stays in the conversation as the assistant's turn (so the conversation stays
turn by turn, and /retry asks again); Ctrl-C at the prompt says how to leave; Ctrl-D or /quit leaves
(tiermoe.cli.chat_terminal).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import threading
from datetime import datetime
from pathlib import Path

import httpx

from tiermoe.cli.api_key import API_KEY_VARIABLE
from tiermoe.cli.chat_backends import RemoteChat
from tiermoe.cli.chat_terminal import LineInput, ctrl_c_sets
from tiermoe.cli.cpu_flags import add_cpu_flags
from tiermoe.cli.flags import add_command, non_negative_float, port_number, positive_int
from tiermoe.cli.speed_line import speed_line
from tiermoe.errors import TiermoeError

# backend -> module with its class, imported only when chosen (the local one loads torch and transformers)
BACKENDS = {"local": ("tiermoe.cli.chat_local", "LocalChat")}

COMMANDS = {
    "/help": "/help, /h          this list",
    "/quit": "/quit, /exit, /q   leave (so does Ctrl-D)",
    "/clear": "/clear, /c         forget the conversation",
    "/history": "/history, /hist    show the conversation",
    "/info": "/info, /i          model, temperature, max tokens, history file",
    "/retry": "/retry, /r         answer the last message again",
}
ALIASES = {"/h": "/help", "/exit": "/quit", "/q": "/quit", "/c": "/clear", "/hist": "/history", "/i": "/info",
           "/r": "/retry"}
LEAVE_HINT = "(Ctrl-D or /quit leaves the chat)"


def history_dir() -> Path:
    """Where conversations are saved without --history-file (kt chat: ~/.ktransformers/chat_history), and the
    typed lines' history (`readline`)."""
    return Path.home() / ".tiermoe" / "chat_history"


def server_url(value: str) -> str:
    """--url: an http(s) URL with a host, checked before the chat starts."""
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL as err:
        raise argparse.ArgumentTypeError(f"'{value}' is not a URL ({err})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT or https://..., got '{value}'")
    return value


def add_parser(sub) -> None:
    p = add_command(
        sub, "chat",
        "Chat in the terminal, as `kt chat` does: with a running `tiermoe serve` (or any OpenAI-compatible server) "
        "at http://127.0.0.1:30000 unless -H/-p/--url say otherwise, or with a model loaded in this process "
        "(--local DIR; the bundled demo model without DIR). Replies stream; the conversation is saved to "
        "~/.tiermoe/chat_history/ unless --no-save-history. Typed at: line editing and the history of typed lines "
        "(arrows, Ctrl-R, Tab for commands); Ctrl-C stops a reply (what was shown stays in the conversation), "
        "Ctrl-D or /quit leaves. Fed from a pipe: one message a line. "
        f"Commands: {', '.join(COMMANDS)}.",
        "tiermoe chat",
        "tiermoe chat -H 192.168.1.5 -p 8080 -t 0.9 --max-tokens 4096 --verbose",
        "tiermoe chat -s 'You are terse.' --no-stream --history-file talk.json",
        "tiermoe chat --local --max-tokens 40",
        "printf 'Hello\\nWhat is an ocean?\\n' | tiermoe chat --local /models/Qwen3-30B-A3B --gpu-device cuda",
    )
    p.add_argument("-H", "--host", default="127.0.0.1", help="server host (default 127.0.0.1)")
    p.add_argument("-p", "--port", type=port_number, default=30000, help="server port (default 30000)")
    p.add_argument("--url", type=server_url, help="the server's base URL instead of -H/-p, e.g. https://host/")
    p.add_argument("-m", "--model", help="served model name (default: the first one the server lists)")
    p.add_argument("--api-key", help=f"API key for servers that require one (default: ${API_KEY_VARIABLE})")
    p.add_argument("-t", "--temperature", type=non_negative_float, default=0.7, help="sampling temperature "
                   "(default 0.7)")
    p.add_argument("--max-tokens", type=positive_int, default=2048, help="tokens per reply at most (default 2048)")
    p.add_argument("-s", "--system", help="system prompt")
    p.add_argument("--save-history", action=argparse.BooleanOptionalAction, default=True,
                   help="save the conversation as JSON after each reply, and the typed lines' history "
                        "(~/.tiermoe/chat_history/readline) at the end (default on)")
    p.add_argument("--history-file", type=Path, help="where to save the conversation (default "
                   "~/.tiermoe/chat_history/chat_<time>.json)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print replies as they are generated (default on)")
    p.add_argument("--verbose", action="store_true",
                   help="after each streamed reply, print its prompt tokens, time to first token and decode "
                        "tokens/s on stderr (with a server: its token counts, timed here)")
    p.add_argument("--local", nargs="?", const="", metavar="DIR",
                   help="load the model in this process instead of using a server (without DIR: the demo model)")
    p.add_argument("--gpu-device", default="cpu", help="with --local: cuda, cuda:N or cpu (default cpu)")
    add_cpu_flags(p)


class Conversation:
    """The messages so far and the file they are saved to (kt chat's JSON: model, timestamp, messages)."""

    def __init__(self, args, model: str):
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.messages: list[dict] = []
        self.model = model
        self.path = None
        if args.save_history:
            self.path = args.history_file or history_dir() / f"chat_{datetime.now():%Y%m%d_%H%M%S}.json"

    def all(self) -> list[dict]:
        return self.system + self.messages

    def save(self) -> None:
        if self.path is None or not self.messages:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"model": self.model, "timestamp": datetime.now().isoformat(),
                                             "messages": self.all()}, indent=2, ensure_ascii=False))
        except OSError as err:
            print(f"warning: cannot save the history to {self.path}: {err.strerror}", file=sys.stderr)
            self.path = None


def answer(backend, conversation: Conversation, args) -> None:
    """Prints the reply to the conversation and adds it; Ctrl-C stops it, and what was shown is kept."""
    print("assistant> ", end="", flush=True)
    reply, stop, stopped = [], threading.Event(), False
    deltas = backend.reply(conversation.all(), stop)
    try:
        with ctrl_c_sets(stop) if backend.stops_between_tokens else contextlib.nullcontext():
            for delta in deltas:
                if not delta.reasoning:
                    reply.append(delta.text)
                if args.stream:
                    print(delta.text, end="", flush=True)
        stopped = stop.is_set()
    except KeyboardInterrupt:  # a server's reply: leaving the stream below closes the request
        stopped = True
    finally:
        deltas.close()
    if not args.stream:
        print("".join(reply), end="")
    print(flush=True)  # the reply stands before what follows on stderr (--verbose, errors)
    if stopped:
        print("(reply stopped; /retry asks again)", flush=True)
    conversation.messages.append({"role": "assistant", "content": "".join(reply)})
    conversation.save()
    stats = backend.stats
    if args.verbose and stats is not None and not stopped:
        print(speed_line(stats.prompt_tokens, stats.ttft_s, stats.decode_tokens, stats.decode_s), file=sys.stderr,
              flush=True)


def slash_command(text: str, backend, conversation: Conversation, args) -> bool:
    """Runs one /command; False when the chat should end."""
    command = ALIASES.get(text.split()[0].lower(), text.split()[0].lower())
    if command == "/quit":
        return False
    if command == "/clear":
        conversation.messages.clear()
        print("(conversation cleared)")
    elif command == "/history":
        for message in conversation.all() or [{"role": "(empty)", "content": "no messages yet"}]:
            print(f"{message['role']}: {message['content']}")
    elif command == "/info":
        print(f"model {backend.describe()}, temperature {args.temperature}, max tokens {args.max_tokens}, "
              f"{len(conversation.messages)} messages, history {conversation.path or 'not saved'}")
    elif command == "/retry":
        if conversation.messages and conversation.messages[-1]["role"] == "assistant":
            conversation.messages.pop()
            answer(backend, conversation, args)
        else:
            print("(no reply to retry yet)")
    elif command == "/help":
        print("\n".join(COMMANDS.values()))
    else:
        print(f"unknown command {command}; /help lists them")
    return True


def make_backend(args):
    if args.local is None:
        return RemoteChat(args)
    module, name = BACKENDS["local"]
    return getattr(importlib.import_module(module), name)(args)


def run(args) -> int:
    if args.local is not None and args.url:
        raise TiermoeError("--local loads the model here and --url names a server: give one of them")
    backend = make_backend(args)
    interactive = sys.stdin.isatty()
    lines = LineInput(interactive, history_dir() / "readline" if args.save_history else None,
                      [*COMMANDS, *ALIASES])
    try:
        conversation = Conversation(args, backend.connect())
        if interactive:
            print(f"chatting with {backend.describe()} (temperature {args.temperature}, max tokens "
                  f"{args.max_tokens}). /help lists the commands; Ctrl-C stops a reply; Ctrl-D or /quit leaves.")
        while True:
            try:
                line = lines.read("you> ")
            except KeyboardInterrupt:  # at the prompt: nothing to stop, so say how to leave
                print(f"\n{LEAVE_HINT}", flush=True)
                continue
            if line is None:
                break
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not slash_command(text, backend, conversation, args):
                    break
                continue
            conversation.messages.append({"role": "user", "content": text})
            if not interactive:
                print(f"you> {text}")
            try:
                answer(backend, conversation, args)
            except TiermoeError as err:  # as kt chat: say so, forget the message, keep chatting
                print(f"\nerror: {err}", file=sys.stderr, flush=True)
                conversation.messages.pop()
    finally:
        backend.close()
        lines.close()
    if conversation.path is not None and conversation.messages:
        print(f"history saved to {conversation.path}", file=sys.stderr)
    return 0
