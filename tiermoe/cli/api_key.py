"""The API key a server requires and a client sends: $TIERMOE_API_KEY, or the flags that name one. Imports nothing
heavy: `tiermoe chat` reads the variable too, and starts without torch."""

from __future__ import annotations

import os
from pathlib import Path

from tiermoe.errors import TiermoeError

API_KEY_VARIABLE = "TIERMOE_API_KEY"


def api_key_from_args(args, environ=None) -> str | None:
    """The API key the server requires: --api-key, else the first line of --api-key-file, else $TIERMOE_API_KEY
    (an empty variable counts as unset), else None (no key)."""
    environ = os.environ if environ is None else environ
    flag, path = getattr(args, "api_key", None), getattr(args, "api_key_file", None)
    if flag is not None and path is not None:
        raise TiermoeError("give --api-key or --api-key-file, not both")
    if flag is not None:
        return flag
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            reason = getattr(err, "strerror", None) or err
            raise TiermoeError(f"cannot read --api-key-file '{path}': {reason}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise TiermoeError(f"--api-key-file '{path}' is empty; expected the key on its first line")
        return key
    return environ.get(API_KEY_VARIABLE) or None
