"""A checkpoint's weight files placed in another folder: hard links where the filesystem allows, else copies.

`tiermoe convert` puts the source's weights inside its output so the output loads without the source. A hard
link costs no disk and, like a copy, outlives the source being moved or deleted (the data stays while one name
is left); across filesystems, or where links are refused, the bytes are copied, after checking that the free
space holds them, so a full disk is one line before hours of copying rather than an OSError at the end.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tqdm.auto import tqdm

from tiermoe.errors import TiermoeError

_COPY_CHUNK = 64 << 20  # bytes read and written at a time: bounded memory whatever the file size


def link_or_copy(files: list[Path], dest: Path, progress: bool = True) -> str:
    """Place every file of `files` in the existing folder `dest` under its own name; returns "linked", "copied"
    or "linked and copied" (what happened, for the model card)."""
    linked, to_copy = [], []
    for f in files:
        try:
            os.link(f, dest / f.name)  # follows a symlink (a Hugging Face cache snapshot) to its blob
            linked.append(f)
        except OSError:  # another filesystem (EXDEV), or one without hard links
            to_copy.append(f)
    if to_copy:
        _copy(to_copy, dest, progress)
    return " and ".join(w for w, fs in (("linked", linked), ("copied", to_copy)) if fs) or "linked"


def _copy(files: list[Path], dest: Path, progress: bool) -> None:
    need = sum(f.stat().st_size for f in files)
    free = shutil.disk_usage(dest).free
    if need > free:
        raise TiermoeError(f"copying the source's weights into {dest} needs {need / 2**30:,.1f} GiB and "
                           f"{free / 2**30:,.1f} GiB are free there; free space, or write --out on the source's "
                           "filesystem (the weights are then hard-linked, not copied)")
    with tqdm(total=need, unit="B", unit_scale=True, desc="copying the source's weights", disable=not progress) as bar:
        for f in files:
            target = dest / f.name
            try:
                with open(f, "rb") as src, open(target, "wb") as out:
                    while chunk := src.read(_COPY_CHUNK):
                        out.write(chunk)
                        bar.update(len(chunk))
                shutil.copystat(f, target)  # the mtime the cache's fingerprint records
            except OSError as err:
                raise TiermoeError(f"copying {f} to {target} failed: {err.strerror or err}") from None
