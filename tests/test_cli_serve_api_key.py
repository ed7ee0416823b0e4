"""The server's API key comes from the command line, a file (--api-key-file) or the environment (TIERMOE_API_KEY),
and is never copied onto another process's command line (visible to every user in `ps`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest
from conftest import run_cli, save_char_tokenizer, save_tiny

from tiermoe.cli.serve_flags import add_serve_flags, api_key_from_args
from tiermoe.cli.serve_ranks import rank_flags
from tiermoe.errors import TiermoeError

KEY = "s3cret-key"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return parser.parse_args(list(argv))


def test_the_key_comes_from_the_flag_a_file_or_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    env = {"TIERMOE_API_KEY": "from-env"}
    assert api_key_from_args(parse(), {}) is None
    assert api_key_from_args(parse(), env) == "from-env"
    assert api_key_from_args(parse("--api-key-file", str(key_file)), env) == KEY  # a flag wins over the environment
    assert api_key_from_args(parse("--api-key", "x"), env) == "x"
    assert api_key_from_args(parse(), {"TIERMOE_API_KEY": ""}) is None


@pytest.mark.parametrize("problem, fragment", [("missing", "cannot read"), ("empty", "is empty"),
                                               ("both", "not both")])
def test_a_bad_key_source_is_one_line(tmp_path, problem, fragment):
    key_file = tmp_path / "key"
    if problem == "empty":
        key_file.write_text("\n")
    elif problem == "both":
        key_file.write_text(KEY)
    argv = ["--api-key-file", str(key_file)] + (["--api-key", KEY] if problem == "both" else [])
    with pytest.raises(TiermoeError, match=fragment):
        api_key_from_args(parse(*argv), {})
    result = run_cli("serve", "--model", "/nonexistent/model", *argv)
    assert result.returncode == 2 and "Traceback" not in result.stderr and fragment in result.stderr, result.stderr


@pytest.mark.parametrize("argv", [("--api-key", KEY), ("--api-key-file", "/run/secrets/key")])
def test_the_key_is_never_on_a_child_ranks_command_line(argv):
    flags = rank_flags(parse("--num-gpus", "2", "--port", "4000", *argv))
    assert flags == ["--port", "4000", "--num-gpus", "2"]
    assert KEY not in " ".join(flags)


def test_chat_takes_the_key_from_the_environment(monkeypatch):
    from tiermoe.cli.chat_backends import RemoteChat
    from tiermoe.cli.chat_cmd import add_parser

    monkeypatch.setenv("TIERMOE_API_KEY", KEY)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    chat = RemoteChat(parser.parse_args(["chat", "--url", "http://127.0.0.1:1"]))
    assert chat.client.headers["Authorization"] == f"Bearer {KEY}"
    chat.close()


def test_a_server_started_with_a_key_file_requires_it_and_ps_does_not_show_it(tmp_path):
    from tiermoe.testing.server_process import ServerProcess

    model = save_tiny("qwen3_moe", tmp_path / "model")
    save_char_tokenizer(model)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    server = ServerProcess(model, "--api-key-file", str(key_file))
    try:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        ok = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
        assert KEY not in cmdline
    finally:
        server.stop()
