"""The repository holds only what is ours to keep: no wheels, archives or large files (tools come from the package
registry at set-up), the bundled demo model excepted."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LARGEST_TRACKED_BYTES = 2 * 1024 * 1024
BUNDLED_MODEL = "tiermoe/bundled/tiermoe-demo/"
NOT_OURS = (".whl", ".tar.gz", ".zip", ".egg")


def tracked_files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an sdist or an unpacked archive)")
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [name for name in listing.stdout.decode().split("\0") if name]


def test_no_tracked_file_over_2_mb_but_the_bundled_model():
    large = [name for name in tracked_files() if not name.startswith(BUNDLED_MODEL)
             and (ROOT / name).is_file() and (ROOT / name).stat().st_size > LARGEST_TRACKED_BYTES]
    assert large == [], f"tracked files over 2 MB (keep them out of git): {large}"


def test_no_wheels_or_archives_are_tracked():
    packaged = [name for name in tracked_files() if name.endswith(NOT_OURS)]
    assert packaged == [], f"wheels or archives tracked (install them from the registry instead): {packaged}"
