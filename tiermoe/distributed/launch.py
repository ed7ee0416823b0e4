"""Starting the ranks of one host without torchrun: `tiermoe serve --num-gpus N`, tests and benchmarks.

Each rank gets the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT). `tiermoe serve --num-gpus N` starts ranks 1..N-1 as child processes
running `python -m tiermoe.serve` with the same flags, and becomes rank 0 itself: no extra interpreter, and
Ctrl-C reaches rank 0 directly. The children exit when rank 0 stops them, or by themselves when it dies (their
collectives fail); whatever is left after a grace period is killed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, addr: str = "127.0.0.1", node_rank: int = 0,
             local_rank: int | None = None, local_world_size: int | None = None) -> dict[str, str]:
    """The variables torchrun sets for one rank."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": addr, "MASTER_PORT": str(port),
            "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
            "GROUP_RANK": str(node_rank)}


def spawn_ranks(argv: list[str], world_size: int, ranks=None, port: int | None = None,
                env: dict | None = None, **popen) -> list[subprocess.Popen]:
    """Start `argv` once per rank in `ranks` (default all) on this host; returns the processes, by rank."""
    port = port or free_port()
    procs = []
    for rank in (range(world_size) if ranks is None else ranks):
        rank_vars = rank_env(rank, world_size, port)
        procs.append(subprocess.Popen(argv, env={**os.environ, **(env or {}), **rank_vars}, **popen))
    return procs


def reap(procs: list[subprocess.Popen], grace_s: float) -> list[int]:
    """Wait up to `grace_s` for the processes to exit, then kill the rest; returns their exit codes."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]
