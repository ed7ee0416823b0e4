"""Statistics files as text: tell a trace CSV, a heat-matrix CSV and a binary `.pt` apart by their content, and
read the text ones into the dicts the `.pt` dumps hold (see trace_csv.py and heat_csv.py for the formats).

The content decides, not the name: a `.pt` renamed `.csv` still loads. A text file in neither format is one
error naming what was found (and, for the layouts `tiermoe trace convert` knows, the command that converts it).
"""

from __future__ import annotations

from itertools import count
from pathlib import Path

from tiermoe.errors import TiermoeError
from tiermoe.stats.heat_csv import read_heat_csv
from tiermoe.stats.trace_csv import read_trace_csv

BINARY_MAGIC = (b"PK", b"\x80")  # torch.save's zip archive; a legacy pickle


def is_text_file(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(2)
    return bool(head) and not head.startswith(BINARY_MAGIC)


def _known_layout(comments: list[str], header: str) -> str | None:
    """Which `tiermoe trace convert --from` layout a foreign text file looks like, if any."""
    text = " ".join(comments)
    if "ALPH=" in text:
        return "esft-trace"
    if header.startswith("turn,phase,step,layer,slot,expert"):
        return "route-trace"
    return None


def read_text_statistics(path: Path) -> dict:
    """A text statistics file as the dict its `.pt` counterpart holds (a per_token trace or a stat dump)."""
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as err:
        raise TiermoeError(f"cannot read '{path}': {err.strerror or err}") from None
    with handle:
        lines = zip(count(1), handle)
        comments: list[str] = []
        header = None
        try:
            for _, line in lines:
                if line.startswith("#"):
                    comments.append(line)
                elif line.strip():
                    header = line.strip()
                    break
            if header is None:
                raise TiermoeError(f"'{path}' is an empty text file: no header line")
            if header.replace(" ", "").startswith("seq,") or ",experts" in header:
                return read_trace_csv(path, comments, header, lines)
            if header.startswith("layer,"):
                return read_heat_csv(path, comments, header, lines)
        except UnicodeDecodeError:
            raise TiermoeError(f"'{path}' is neither a .pt file nor UTF-8 text") from None
    layout = _known_layout(comments, header)
    hint = (f"; convert it with `tiermoe trace convert --from {layout} {path} OUT.csv`" if layout else "")
    raise TiermoeError(f"'{path}' is not a statistics file: a text file whose header '{header[:60]}' is neither a "
                       f"routing trace (seq,pos,layer,experts) nor a heat matrix (layer,e0,e1,...){hint}")
