"""User-facing errors.

A `TiermoeError` is a mistake in what the user gave us (a path, a flag, a file), not a bug: the CLI prints its
message as one line and exits with status 2, without a traceback. Messages say what is wrong and what is expected.
"""


class TiermoeError(ValueError):
    """Bad input from the user: printed as one line by the CLI."""
