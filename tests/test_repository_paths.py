"""Tracked text names no folder of one particular machine, and the routing data it names is in the repository.

A command or comment with an absolute home, work or scratch folder in it works only where it was written: commands
write scratch files under a relative folder (`scratch/`, which git ignores) or the temporary folder the code asks the
system for (`tempfile`), and read the published routing data from `data/routing/`."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Searched: text that people read or run. Not searched: JSON (benchmark results under benchmarks/results/, the
# bundled model's config and training log: records a program wrote, which keep the paths their run was given) and
# CSV (the published routing data keeps its authors' headers as they wrote them).
TEXT_FILES = ("*.md", "*.py", "*.sh", "*.txt", "*.toml", "*.yaml", "*.yml")
MACHINE_FOLDERS = ("tmp", "work", "home", "root", "Users")
# One of those folders as a whole path component right after something that starts a path (line start, space,
# quote, bracket, `=`, `:`, `-` of `${VAR:-/tmp}`): a URL's path such as https://host/work/x has a letter before
# its slash and is not matched.
ABSOLUTE = re.compile(r"(?:^|[^\w.~/])/(?:" + "|".join(MACHINE_FOLDERS) + r")(?=[/\"'}:)\s]|$)")
# Each exception on purpose: a line holding the snippet may name the folder. Every snippet must still be found.
ALLOWED = {
    'SGLANG_DEFAULT_DIR = "/tmp"': "SGLang's expert-distribution recorder writes to /tmp when neither variable names "
                                  "a folder; keeping its default keeps its users' scripts working (tiermoe.stats.io)",
    "else /tmp": "the recorder's help and docstrings say where that default writes",
    'type(tmp_path)("/tmp")  # SGLang\'s default': "the test of that default",
    "${TMPDIR:-/tmp}/tiermoe-gpu-check-site": "the GPU check installs its carried wheels for one run in the "
                                              "system's temporary folder ($TMPDIR, else /tmp, as mktemp does)",
}
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()  # names what it looks for: not searched
ROUTING_DATA = re.compile(r"(?<![\w/])data/routing/[\w.-]+(?:/[\w.-]+)*")


def tracked_text() -> dict[str, str]:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout (an sdist or an unpacked archive)")
    listing = subprocess.run(["git", "ls-files", "-z", "--", *TEXT_FILES], cwd=ROOT, capture_output=True, check=True)
    files = [name for name in listing.stdout.decode().split("\0") if name and (ROOT / name).is_file()]
    return {name: (ROOT / name).read_text(errors="replace") for name in files if name != THIS_FILE}


def test_no_tracked_text_names_a_folder_of_one_machine():
    found = [f"{name}:{number}: {line.strip()[:100]}"
             for name, text in tracked_text().items()
             for number, line in enumerate(text.splitlines(), 1)
             if ABSOLUTE.search(line) and not any(snippet in line for snippet in ALLOWED)]
    assert found == [], ("absolute paths of one machine (write scratch/ or a relative path, or use tempfile; an "
                         "exception on purpose goes in ALLOWED with its reason):\n" + "\n".join(found))


def test_every_allowed_exception_is_still_used():
    texts = tracked_text().values()
    unused = [snippet for snippet in ALLOWED if not any(snippet in text for text in texts)]
    assert unused == [], f"exceptions no tracked file needs any more (remove them): {unused}"


def test_the_pattern_tells_a_machine_path_from_a_url_and_a_relative_one():
    assert ABSOLUTE.search("--out /tmp/x.json") and ABSOLUTE.search('default="/tmp"')
    assert ABSOLUTE.search("cd /work/main &&") and ABSOLUTE.search("(`/home/me/models`)")
    assert ABSOLUTE.search("SITE=${TMPDIR:-/tmp}/site") and ABSOLUTE.search("/Users/me")
    for fine in ("--out scratch/tmp/x.json", "https://github.com/o/r/tree/main/work/x", "/tmpfs", "a/home/b",
                 "~/.cache/tiermoe", "$TMPDIR/x"):
        assert not ABSOLUTE.search(fine), fine


def test_the_routing_data_named_in_tracked_text_is_in_the_repository():
    """Commands read the published routing data inside the repository, so each path they name must exist (a moved
    or renamed file fails here), and nothing reads it from a folder beside the checkout."""
    named, outside = set(), []
    for name, text in tracked_text().items():
        named |= {path.rstrip(".") for path in ROUTING_DATA.findall(text)}
        if "shared/routing-data" in text:
            outside.append(name)
    assert outside == [], f"routing data read from outside the repository (use data/routing/): {outside}"
    assert named, "no tracked text names data/routing/ (the benchmarks' commands should)"
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert missing == [], f"paths under data/routing/ that do not exist: {missing}"


def test_the_routing_data_carries_its_sources_and_licences():
    data = ROOT / "data" / "routing"
    readme = (data / "README.md").read_text()
    for folder, licence in (("esft-deepseek-v2-lite", "LICENSE-CODE.ESFT"), ("qwen3-moe-heat", "LICENSE.mbolt"),
                            ("decode-route-traces", "LICENSE.BigMoeOnEdge")):
        assert (data / folder / licence).is_file(), f"{folder} without its licence {licence}"
        assert f"`{folder}/`" in readme and licence in readme, f"README.md does not describe {folder}"
