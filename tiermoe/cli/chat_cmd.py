"""tiermoe chat: a streaming terminal chat with history, against a server (--url) or in-process."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tiermoe.cli.cpu_flags import add_cpu_flags, cpu_from_args
from tiermoe.cli.flags import add_command, non_negative_float, positive_int
from tiermoe.cli.serve_flags import API_KEY_VARIABLE
from tiermoe.config import check_device
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError

HELP = "/quit (or Ctrl-D) leaves, /clear forgets the conversation, /history shows it, /help shows this"


def server_url(value: str) -> str:
    """--url: an http(s) URL with a host, checked before the chat starts."""
    import httpx

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
        "Chat in the terminal with streamed replies and history. With --url it talks to a running "
        "`tiermoe serve` (or any OpenAI-compatible server); otherwise it loads the model in-process (the bundled "
        "demo model without --model). Works typed at by a person and fed from a pipe (one message per line). "
        + HELP + ".",
        "tiermoe chat",
        "tiermoe chat --url http://127.0.0.1:30000 --system 'You are terse.'",
        "printf 'Hello\\nWhat is an ocean?\\n' | tiermoe chat --max-tokens 40",
    )
    p.add_argument("--url", type=server_url, help="base URL of a running server, e.g. http://127.0.0.1:30000")
    p.add_argument("--api-key", help=f"API key for --url servers that require one (default: ${API_KEY_VARIABLE})")
    p.add_argument("--model", "--model-path", dest="model", help="checkpoint directory for in-process chat")
    p.add_argument("--gpu-device", default="cpu", help="in-process: cuda, cuda:N or cpu (default cpu)")
    p.add_argument("--system", help="system message")
    p.add_argument("--temperature", type=non_negative_float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--max-tokens", type=positive_int, default=256, help="tokens per reply at most (default 256)")
    add_cpu_flags(p)


class LocalChat:
    def __init__(self, args):
        self.llm = LLM(args.model, gpu_device=check_device(args.gpu_device), progress=sys.stderr.isatty(),
                       cpu=cpu_from_args(args))
        self.args = args

    def reply(self, messages):
        sampling = SamplingParams(max_tokens=self.args.max_tokens, temperature=self.args.temperature)
        yield from self.llm.stream(self.llm.chat_prompt_ids(messages), sampling)

    def close(self):
        self.llm.close()


class RemoteChat:
    def __init__(self, args):
        import httpx

        key = args.api_key or os.environ.get(API_KEY_VARIABLE)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=None)
        self.args = args

    def reply(self, messages):
        import httpx


        body = {"model": "default", "messages": messages, "stream": True, "max_tokens": self.args.max_tokens,
                "temperature": self.args.temperature}
        try:
            with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise TiermoeError(f"server answered {response.status_code}: {response.text[:300]}")
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[6:]).get("choices", []):
                        text = choice.get("delta", {}).get("content")
                        if text:
                            yield text
        except httpx.HTTPError as err:
            raise TiermoeError(f"cannot reach {self.args.url}: {err}") from None

    def close(self):
        self.client.close()


def run(args) -> int:
    backend = RemoteChat(args) if args.url else LocalChat(args)
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    if interactive:
        print(f"chatting ({'server ' + args.url if args.url else 'in-process'}). {HELP}.")
    try:
        while True:
            try:
                line = input("you> " if interactive else "")
            except EOFError:
                break
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                command = text.split()[0]
                if command == "/quit":
                    break
                if command == "/clear":
                    history.clear()
                    print("(conversation cleared)")
                elif command == "/history":
                    for m in system + history:
                        print(f"{m['role']}: {m['content']}")
                elif command == "/help":
                    print(HELP)
                else:
                    print(f"unknown command {command}; {HELP}")
                continue
            history.append({"role": "user", "content": text})
            if not interactive:
                print(f"you> {text}")
            print("assistant> ", end="", flush=True)
            answer = []
            for delta in backend.reply(system + history):
                answer.append(delta)
                print(delta, end="", flush=True)
            print()
            history.append({"role": "assistant", "content": "".join(answer)})
    finally:
        backend.close()
    return 0
