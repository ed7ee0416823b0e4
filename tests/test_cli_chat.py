"""`tiermoe chat` behaves like `kt chat`: it connects to a server (127.0.0.1:30000 unless -H/-p say otherwise) with
kt chat's flags, defaults and slash commands, saves the conversation as kt chat does, and says in one line what to do
when no server runs. The in-process chat is behind --local."""

from __future__ import annotations

import argparse
import io
import json
import re

import httpx
import pytest
from conftest import run_cli
from server_thread import server_thread

from tiermoe.cli.chat_cmd import add_parser
from tiermoe.distributed.launch import free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("chat")) as (url, state):
        yield url, state


def chat(monkeypatch, lines: str, *argv: str):
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    return run_cli("chat", *argv)


def greedy_reply(url: str, messages: list[dict], max_tokens: int) -> str:
    r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                       "temperature": 0}, timeout=60)
    return r.json()["choices"][0]["message"]["content"]


def test_kt_chat_defaults():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chat"])
    assert (args.host, args.port, args.model, args.temperature, args.max_tokens) == ("127.0.0.1", 30000, None, 0.7,
                                                                                   2048)
    assert args.stream and args.save_history and args.local is None and args.system is None
    short = parser.parse_args(["chat", "-H", "10.0.0.1", "-p", "8080", "-m", "m", "-t", "0.2", "-s", "be brief",
                               "--no-stream", "--no-save-history", "--local"])
    assert (short.host, short.port, short.model, short.temperature, short.system) == ("10.0.0.1", 8080, "m", 0.2,
                                                                                      "be brief")
    assert not short.stream and not short.save_history and short.local == ""


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_chat_with_a_server_keeps_history_and_saves_it(server, monkeypatch, tmp_path, stream):
    url, state = server
    port = url.rsplit(":", 1)[1]
    history = tmp_path / "talk.json"
    result = chat(monkeypatch, "hello\n/hist\n/r\n/i\n/c\nagain\n/q\nnever sent\n",
                  "-p", port, "-t", "0", "--max-tokens", "4", "-s", "be brief", "--history-file", str(history), stream)
    assert result.returncode == 0, result.stderr
    system = {"role": "system", "content": "be brief"}
    first = greedy_reply(url, [system, {"role": "user", "content": "hello"}], 4)
    second = greedy_reply(url, [system, {"role": "user", "content": "again"}], 4)
    out = result.stdout
    assert out.count(f"assistant> {first}\n") == 2  # the reply, then /retry's
    assert f"assistant> {second}\n" in out and "never sent" not in out
    assert "user: hello" in out and "(conversation cleared)" in out and "model tiny at" in out
    saved = json.loads(history.read_text())
    assert saved["model"] == "tiny"
    assert saved["messages"] == [system, {"role": "user", "content": "again"}, {"role": "assistant",
                                                                                  "content": second}]
    assert f"history saved to {history}" in result.stderr


def test_history_goes_to_the_home_directory_by_default(server, monkeypatch, tmp_path):
    url, _ = server
    monkeypatch.setenv("HOME", str(tmp_path))
    result = chat(monkeypatch, "hi\n", "--url", url, "--max-tokens", "2")
    assert result.returncode == 0, result.stderr
    [saved] = (tmp_path / ".tiermoe" / "chat_history").glob("chat_*.json")
    assert [m["role"] for m in json.loads(saved.read_text())["messages"]] == ["user", "assistant"]


def test_a_model_the_server_does_not_serve_falls_back_to_its_first(server, monkeypatch):
    url, _ = server
    result = chat(monkeypatch, "/info\n", "--url", url, "-m", "other", "--no-save-history")
    assert result.returncode == 0, result.stderr
    assert "model 'other' is not served" in result.stderr and "model tiny at" in result.stdout


def test_no_server_is_one_line_that_says_what_to_do(monkeypatch, tmp_path):
    result = chat(monkeypatch, "hello\n", "-p", str(free_port()), "--no-save-history")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: no server at http://127.0.0.1:") and "tiermoe serve" in line
    assert "tiermoe chat --local" in line and "assistant>" not in result.stdout
    folder = tmp_path / "model"
    folder.mkdir()
    result = chat(monkeypatch, "", "-p", str(free_port()), "-m", str(folder))
    assert f"--local {folder}" in result.stderr


def test_verbose_prints_each_replys_speed_from_the_servers_counts(server, monkeypatch):
    url, state = server
    result = chat(monkeypatch, "hello\n", "--url", url, "-t", "0", "--max-tokens", "4", "--no-save-history",
                  "--verbose")
    assert result.returncode == 0, result.stderr
    [speed] = [line for line in result.stderr.splitlines() if line.startswith("prompt ")]
    prompt = len(state.llm.chat_prompt_ids([{"role": "user", "content": "hello"}]))
    assert re.fullmatch(rf"prompt {prompt} tokens, first token \d+\.\d\d s, decode [0-3] tokens?( at .* tok/s)?",
                        speed), speed
    quiet = chat(monkeypatch, "hello\n", "--url", url, "--max-tokens", "2", "--no-save-history")
    assert "first token" not in quiet.stderr
