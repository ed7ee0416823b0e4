"""Starting the ranks of one host without torchrun: `tiermoe serve --num-gpus N`, tests and benchmarks.

Each rank gets the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT). `tiermoe serve --num-gpus N` starts ranks 1..N-1 as child processes
running `python -m tiermoe.serve` with the same flags, and becomes rank 0 itself: no extra interpreter, and
Ctrl-C reaches rank 0 directly. The children exit when rank 0 stops them, or by themselves when it dies (their
collectives fail); whatever is left after a grace period is killed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

from tiermoe.distributed.group import RankEnv


def free_port() -> int:
    import socket

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


def serve_flags(args: argparse.Namespace) -> list[str]:
    """The command line that gives `python -m tiermoe.serve` the same settings as `args` (non-defaults only)."""
    from tiermoe.cli.serve_cmd import add_serve_flags

    parser = argparse.ArgumentParser(add_help=False)
    add_serve_flags(parser)
    flags = []
    for action in parser._actions:
        if not action.option_strings or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if action.nargs == 0:  # store_true and friends
            if value == action.const:
                flags.append(action.option_strings[0])
            continue
        flags += [action.option_strings[0], str(value)]
    return flags


def serve_with_local_ranks(args: argparse.Namespace, num_ranks: int) -> int:
    """Be rank 0 of `num_ranks` ranks on this host, with ranks 1.. as child processes (see the docstring)."""
    from tiermoe.distributed.serve_rank import serve_rank

    port = free_port()
    children = spawn_ranks([sys.executable, "-m", "tiermoe.serve", *serve_flags(args)], num_ranks,
                           ranks=range(1, num_ranks), port=port)
    os.environ.update(rank_env(0, num_ranks, port))
    started = threading.Event()
    threading.Thread(target=_watch_start, args=(children, started), name="tiermoe-rank-watch", daemon=True).start()
    ok = False
    try:
        code = serve_rank(args, RankEnv.from_env(), on_group=started.set)
        ok = True
        return code
    finally:
        # stopped cleanly: the children got rank 0's stop message; failed: they notice within the timeout
        reap(children, grace_s=30.0 if ok else args.dist_timeout + 5.0)


def _watch_start(children: list[subprocess.Popen], started: threading.Event) -> None:
    """Until the process group is up, a child that exits means rank 0 would wait for it in the rendezvous for
    the whole (long) start-up timeout: say which rank failed and stop now. Later failures the collectives see."""
    while not started.wait(0.5):
        for rank, child in enumerate(children, start=1):
            code = child.poll()
            if code is not None:
                print(f"error: rank {rank} exited with status {code} while the ranks were starting (its output "
                      "says why)", file=sys.stderr, flush=True)
                for other in children:
                    if other.poll() is None:
                        other.kill()
                os._exit(2)  # rank 0's main thread is blocked in the rendezvous and holds nothing to clean up


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
