"""What README, docs, examples and benchmarks name exists: a file path of the repository (`tiermoe/stats/io.py`,
`benchmarks/e2e/worker.py`, `tiermoe/routing/`) or a Python name (`tiermoe.routing.generator.generate_requests`).
A moved or renamed module fails here until the text that names it follows.

Checked: paths under tiermoe/, tests/, examples/, scripts/, docs/ and benchmarks/ ending in a file suffix, or a
tiermoe/ folder ending in `/`; not benchmarks/results/ (what a command writes, named before it runs) nor prefixes
of a pattern (`tests/test_server_*.py`). Python names are resolved from the source (the module's file, the
module's top-level names for the rest) from the files, without importing tiermoe."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READ = ("README.md", "BENCHMARKS.md", "docs", "examples", "benchmarks", "scripts")
SUFFIXES = (".py", ".sh", ".md", ".toml", ".txt")
PATH = re.compile(r"(?<![\w/.~$-])((?:tiermoe|tests|examples|scripts|docs|benchmarks)/[\w./-]*[\w/])(?![\w*{<-])")
NAME = re.compile(r"(?<![\w./-])tiermoe(?:\.[A-Za-z_]\w*)+")


def named_text() -> dict[str, str]:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout (an sdist or an unpacked archive)")
    listing = subprocess.run(["git", "ls-files", "-z", "--", *READ], cwd=ROOT, capture_output=True, check=True)
    names = [n for n in listing.stdout.decode().split("\0") if n.endswith(SUFFIXES) and (ROOT / n).is_file()
             and not n.startswith("benchmarks/results/")]
    return {n: (ROOT / n).read_text(errors="replace") for n in names}


def checked_path(path: str) -> bool:
    if path.startswith(("benchmarks/results/", "benchmarks/gpu_wheels")):
        return False
    return path.endswith(SUFFIXES) or (path.startswith("tiermoe/") and path.endswith("/"))


@cache
def top_level_names(source: Path) -> frozenset[str]:
    """What `module.name` can be: defined, assigned or imported at the top; with a module `__getattr__` (a lazy
    map, as tiermoe/__init__.py has), also the string keys of its top-level dicts."""
    body = ast.parse(source.read_text()).body
    lazy = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in body)
    names = set()
    for node in body:
        if lazy and isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def module_source(parts: list[str]) -> Path | None:
    """The file of module `parts` (a package's __init__.py), found in the tree."""
    base = ROOT.joinpath(*parts)
    for source in (base.with_suffix(".py"), base / "__init__.py"):
        if source.is_file():
            return source
    return None


def resolves(name: str) -> bool:
    """tiermoe.a.b.c: the longest prefix that is a module of the tree, then the next part one of its top-level
    names (what follows is an attribute of that object, not checked)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        source = module_source(parts[:end])
        if source is not None:
            return end == len(parts) or parts[end] in top_level_names(source)
    return False


def test_paths_named_in_docs_and_benchmarks_exist():
    missing = sorted({f"{path} ({name})" for name, text in named_text().items() for path in PATH.findall(text)
                      if checked_path(path.rstrip(".")) and not (ROOT / path.rstrip(".")).exists()})
    assert missing == [], "paths that do not exist (moved or renamed? name the new place):\n" + "\n".join(missing)


def test_python_names_in_docs_and_benchmarks_resolve():
    missing = sorted({f"{found} ({name})" for name, text in named_text().items() for found in NAME.findall(text)
                      if not resolves(found)})
    assert missing == [], "tiermoe names that do not resolve:\n" + "\n".join(missing)


def test_the_checks_catch_a_moved_module():
    assert resolves("tiermoe.routing.generator.generate_requests") and resolves("tiermoe.stats")
    assert resolves("tiermoe.LLM") and not resolves("tiermoe.NoSuchThing")
    assert not resolves("tiermoe.stats.routing_generator.generate_requests")
    assert not resolves("tiermoe.routing.generator.no_such_name")
    assert PATH.findall("see `tiermoe/stats/routing_fit.py`.") == ["tiermoe/stats/routing_fit.py"]
    assert PATH.findall("`tests/test_server_*.py`") == []
