"""`tiermoe serve` run in the test's process up to the point where it would listen until Ctrl-C: flags, fit check,
loading and the server's state are the command's own; `fake(state)` then runs in place of listening."""

from __future__ import annotations

import importlib

# the modules whose run(args) calls serve_http.serve(state), under the name they imported it as
SERVE_CALLERS = ("tiermoe.cli.serve_run",)


def replace_serve(monkeypatch, fake) -> None:
    for name in SERVE_CALLERS:
        module = importlib.import_module(name)
        if hasattr(module, "serve"):
            monkeypatch.setattr(module, "serve", fake)
