"""User-facing errors.

A `TiermoeError` is a mistake in what the user gave us (a path, a flag, a file), not a bug: the CLI prints its
message as one line and exits with status 2, without a traceback. Messages say what is wrong and what is expected.
"""


from collections.abc import Iterator


class TiermoeError(ValueError):
    """Bad input from the user: printed as one line by the CLI."""


def cause_chain(err: BaseException | None) -> Iterator[BaseException]:
    """`err`, then what caused it (`__cause__`, else `__context__`), and so on, each once."""
    seen = set()
    while err is not None and id(err) not in seen:
        yield err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
