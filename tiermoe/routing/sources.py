"""Per-task traces to fit the routing generator to: files in any layout `tiermoe trace convert` reads (an ESFT
trace, a route trace, a trace CSV, a `.pt` per_token dump), or folders of them, one task per file.

A folder contributes its `trace_*.txt` files (the ESFT layout) and its `.csv` files that are traces; a task is
named after its file (`trace_law.txt` -> `law`). Every task must have the same MoE layers, experts and top-k.
"""

from __future__ import annotations

from pathlib import Path

from tiermoe.errors import TiermoeError
from tiermoe.routing.trace_convert import detect_layout, read_routing


def _candidates(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(path.glob("trace_*.txt")) + sorted(p for p in path.glob("*.csv") if _is_trace(p))
        if not found:
            raise TiermoeError(f"'{path}' holds no trace files (trace_*.txt or trace CSVs)")
        return found
    if not path.exists():
        raise TiermoeError(f"'{path}' does not exist")
    return [path]


def _is_trace(path: Path) -> bool:
    try:
        return detect_layout(path) in ("route-trace", "tiermoe")  # a CSV whose header starts seq, or turn,
    except TiermoeError:
        return False


def task_name(path: Path) -> str:
    stem = path.stem
    return stem[len("trace_"):] if stem.startswith("trace_") else stem


def load_task_traces(paths: list[str | Path]) -> dict[str, dict]:
    """{task name: per_token trace} of every trace file in `paths` (files or folders)."""
    traces: dict[str, dict] = {}
    for path in [p for given in paths for p in _candidates(Path(given))]:
        layout = detect_layout(path)
        data = read_routing(path, layout)
        if not (isinstance(data, dict) and data.get("mode") == "per_token" and "topk_ids" in data):
            raise TiermoeError(f"'{path}' holds counts, not a per-token trace: the generator is fitted to traces")
        name = task_name(path)
        while name in traces:
            name += "'"
        traces[name] = data
    shapes = {(tuple(int(x) for x in t["moe_layers"]), int(t["num_experts"]), int(t["topk_ids"].shape[2]))
              for t in traces.values()}
    if len(shapes) > 1:
        raise TiermoeError("the traces to fit differ in MoE layers, experts or top-k: fit one model at a time")
    return traces
