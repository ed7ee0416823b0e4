"""`tiermoe chat` with a server starts at once: building its parser and its server backend imports neither torch
nor transformers (only `--local` loads them, through tiermoe.cli.chat_local)."""

from __future__ import annotations

import importlib
import subprocess
import sys

from tiermoe.cli.chat_cmd import BACKENDS
from tiermoe.cli.chat_local import LocalChat


def test_a_chat_with_a_server_imports_neither_torch_nor_transformers():
    code = ("import argparse, sys\n"
            "from tiermoe.cli.chat_cmd import add_parser, make_backend\n"
            "parser = argparse.ArgumentParser()\n"
            "add_parser(parser.add_subparsers(dest='command'))\n"
            "make_backend(parser.parse_args(['chat', '--url', 'http://127.0.0.1:1'])).close()\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_table_names_the_local_backend_that_chat_local_imports():
    module, name = BACKENDS["local"]
    assert getattr(importlib.import_module(module), name) is LocalChat
