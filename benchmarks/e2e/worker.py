"""One side of bench_e2e_cpu.py in a process of its own: tiermoe (of this tree or, with --compare-commit, another
commit's, by PYTHONPATH) or llama.cpp; or bench_speculative.py's llama.cpp arms (llama_lookup_side.py). Each side
has its own threads and allocator, and an idle side only waits on its pipe while the other is timed.

Protocol: one JSON request per line on stdin ({"op": "load", "backend": ..., "args": {...}}, then {"op": METHOD,
**kwargs} calling that method of the side, {"op": "close"}); one JSON reply per line ({"ok": result} or
{"error": "one line"}) on the stdout this process started with. Everything else that writes to stdout
(C libraries included) is sent to stderr, so it cannot corrupt a reply.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# run as a script, sys.path[0] is this folder: it becomes benchmarks/, so that the sides import as e2e.* (tiermoe's
# side imports bench_non_expert_quant from there too) and this folder's llama_cpp.py cannot hide the llama_cpp package
sys.path[0] = str(Path(__file__).resolve().parents[1])


def open_side(backend: str, args: dict):
    if backend == "llama.cpp":
        from e2e.llama_side import LlamaSide
        return LlamaSide(**args)
    if backend == "llama.cpp-lookup":
        from e2e.llama_lookup_side import LlamaLookupSide
        return LlamaLookupSide(**args)
    from e2e.tiermoe_side import TiermoeSide
    return TiermoeSide(**args)


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    side = None
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "close":
            break
        try:
            if op == "load":
                side = open_side(request["backend"], request["args"])
                result = {"layers": side.layers}
            else:
                result = getattr(side, op)(**request)
            reply = {"ok": result}
        except Exception as err:  # noqa: BLE001 - the benchmark reports it, one line, and goes on without it
            reply = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
        replies.write(json.dumps(reply) + "\n")
    if side is not None:
        side.close()


if __name__ == "__main__":
    main()
