"""The package layering, read from the source: which tiermoe package may import which, with no cycle.

An AST walk over every module of tiermoe/ (imports inside functions and under `if TYPE_CHECKING:` count too,
since they are dependencies all the same). Top-level modules (fit.py, convert.py, ...) count as packages; the
root package (`tiermoe/__init__.py`: the version and a lazy API map) imports nothing and anyone may import it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "tiermoe"

CORE = {"errors", "config", "experts", "checkpoint", "arch", "placement", "stats", "routing", "layers", "model",
        "engine", "distributed", "server", "compat", "fit", "convert", "data", "bundled", "models", "training"}

# package -> the packages it may import (besides itself and the root). Read bottom-up, it is the layering:
# record (stats) and decide/describe (placement) sit below apply (model, engine); what recordings say about routing
# (routing) reads stats' files and nothing below it imports it; analysis and testing sit above
# the core and nothing in the core imports them; only the command line (and `python -m` entry points) import cli.
ALLOWED = {
    "errors": set(),
    "config": {"errors"},
    "experts": {"config", "errors"},
    "checkpoint": {"experts", "errors"},
    "arch": {"checkpoint", "config", "errors"},
    "placement": {"arch", "experts", "config", "errors"},
    "stats": {"config", "errors"},
    "routing": {"stats", "config", "errors"},
    "layers": {"arch", "experts", "stats", "config", "errors"},
    "model": {"arch", "checkpoint", "experts", "layers", "placement", "stats", "config", "errors", "bundled"},
    "engine": {"arch", "checkpoint", "experts", "layers", "model", "placement", "stats", "config", "errors",
               "bundled"},
    "distributed": {"arch", "checkpoint", "experts", "layers", "model", "engine", "placement", "stats", "config",
                    "errors", "bundled"},
    "server": {"engine", "distributed", "model", "placement", "stats", "config", "errors", "bundled"},
    "compat": {"arch", "checkpoint", "distributed", "experts", "model", "placement", "stats", "config", "errors"},
    "fit": {"arch", "checkpoint", "experts", "model", "placement", "config", "errors", "bundled"},
    "convert": {"arch", "checkpoint", "experts", "model", "config", "errors"},
    "data": {"errors", "bundled"},
    "bundled": {"errors"},
    "models": {"bundled"},  # the bundled models' old import path, a re-export
    "training": {"arch", "checkpoint", "experts", "layers", "model", "placement", "stats", "config", "errors", "data",
                 "bundled"},
    "analysis": CORE | {"testing"},
    "testing": CORE,
    "cli": CORE | {"analysis", "testing"},
    "serve": {"cli"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str | None:
    """'tiermoe.stats.io' -> 'stats'; the root -> ''; anything else -> None."""
    parts = module.split(".")
    if parts[0] != "tiermoe":
        return None
    return parts[1] if len(parts) > 1 else ""


def imported_modules(path: Path) -> list[tuple[str, bool]]:
    """(absolute module name, imported at module level) for every import statement of `path`."""
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path)
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # `from tiermoe import stats` imports a package, `from tiermoe import __version__` does not
            names = [f"{module}.{a.name}" for a in node.names if module == "tiermoe" and a.name.islower()
                     and (PACKAGE_ROOT / a.name).exists()]
            found += [(m, id(node) in top_level) for m in (names or [module])]
    return found


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(package, imported package) -> the modules that import it."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        source = package_of(module_name(path))
        for module, _ in imported_modules(path):
            target = package_of(module)
            if target and target != source:
                edges.setdefault((source, target), []).append(module_name(path))
    return edges


def find_cycle(edges) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, stack + [nxt])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_every_package_has_a_row_in_the_table():
    packages = {p.stem for p in PACKAGE_ROOT.glob("*.py") if p.stem != "__init__"}
    packages |= {p.name for p in PACKAGE_ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(ALLOWED), "add a row to ALLOWED for a new package, remove the row of a removed one"


def test_packages_import_only_what_the_table_allows():
    edges = import_edges()
    unknown = {src for src, _ in edges} - set(ALLOWED)
    assert not unknown, f"packages missing from the table: {unknown}"
    bad = [f"{src} -> {dst} ({', '.join(sorted(set(mods)))})" for (src, dst), mods in sorted(edges.items())
           if dst not in ALLOWED[src]]
    assert not bad, "imports the layering does not allow:\n" + "\n".join(bad)


def test_the_table_itself_has_no_cycle():
    table_edges = {(a, b) for a, bs in ALLOWED.items() for b in bs}
    assert find_cycle(table_edges) is None


def test_the_package_graph_has_no_cycle():
    assert find_cycle(import_edges()) is None


def test_tiermoe_modules_are_imported_at_module_level_only():
    """Function-local or TYPE_CHECKING imports of tiermoe's own modules hide dependencies (and cycles)."""
    local = [f"{module_name(path)}: {module}" for path in sorted(PACKAGE_ROOT.rglob("*.py"))
             for module, top in imported_modules(path) if not top and package_of(module) is not None]
    assert not local, "imports of tiermoe modules inside functions or conditions:\n" + "\n".join(local)


def test_only_the_command_line_imports_cli():
    importers = {src for (src, dst) in import_edges() if dst == "cli"}
    assert importers <= {"cli", "serve"}, f"library packages import tiermoe.cli: {importers - {'cli', 'serve'}}"
