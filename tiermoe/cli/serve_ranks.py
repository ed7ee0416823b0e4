"""`tiermoe serve` over several ranks: as one rank of a multi-rank run (rank 0 serves HTTP, the other ranks follow
its steps), and `--num-gpus N` without torchrun (this process is rank 0, ranks 1.. run `python -m tiermoe.serve`
as child processes with the same flags).

Signals: Ctrl-C in a terminal reaches every rank at once, and torchrun forwards SIGTERM to every rank. Rank 0
drains its requests (which needs the followers until the end) and then stops them; so a follower ignores the
first SIGINT or SIGTERM and waits for rank 0's stop message, and only a second signal ends it at once.
Rank 0 turns SIGTERM into a clean exit while loading, so its shared-memory files are removed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading

from tiermoe.cli.cpu_flags import cpu_from_args
from tiermoe.cli.placement_args import placement_from_args
from tiermoe.cli.placement_flags import dynamic_from_args
from tiermoe.cli.serve_flags import add_serve_flags, server_config_from_args
from tiermoe.cli.serve_http import build_state, serve
from tiermoe.distributed.group import RankEnv, RankFailure, RankGroup, rank_device
from tiermoe.distributed.launch import free_port, rank_env, reap, spawn_ranks
from tiermoe.distributed.rank_model import RankModel
from tiermoe.server.gc_freeze import freeze_startup_heap

# Never on a child's command line: any user can read it (`ps`). Only rank 0 serves HTTP, so the other ranks need
# no key at all (nor the file it is in).
SECRET_FLAGS = ("api_key", "api_key_file")


def rank_flags(args: argparse.Namespace) -> list[str]:
    """The command line that gives `python -m tiermoe.serve` the same settings as `args` (non-defaults only),
    without the API key (SECRET_FLAGS)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_flags(parser)
    flags = []
    for action in parser._actions:
        if not action.option_strings or not hasattr(args, action.dest) or action.dest in SECRET_FLAGS:
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(value, list):  # --allowed-origins: one comma-separated value
            value = ",".join(map(str, value))
        if action.nargs == 0:  # store_true and friends
            if value == action.const:
                flags.append(action.option_strings[0])
            continue
        flags += [action.option_strings[0], str(value)]
    return flags


def leave_on_rank_failure(serve, *args) -> int:
    """`serve(*args)`; when another rank died, say so and end this process at once with status 2, once serve's
    own cleanup (shared-memory files, child ranks) has run. A gloo process group that lost a peer cannot be
    destroyed, and leaving it to the interpreter's exit aborts the process now and then (gloo's worker threads
    still hold work: "terminate called without an active exception", status -6 instead of 2)."""
    try:
        return serve(*args)
    except RankFailure as err:
        sys.stdout.flush()
        print(f"error: {err}", file=sys.stderr, flush=True)
        os._exit(2)


def serve_with_local_ranks(args: argparse.Namespace, num_ranks: int) -> int:
    """Be rank 0 of `num_ranks` ranks on this host, with ranks 1.. as child processes (see the docstring)."""
    port = free_port()
    children = spawn_ranks([sys.executable, "-m", "tiermoe.serve", *rank_flags(args)], num_ranks,
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


def serve_rank(args, env: RankEnv, on_group=None) -> int:
    """Run `tiermoe serve` as rank `env.rank`. `on_group()` is called once the process group is up."""
    device = rank_device(args.gpu_device, env)
    leads = env.rank == 0
    (_leader_signals if leads else _follower_signals)(env.rank)
    group = RankGroup(env, device, args.dist_timeout)
    if on_group is not None:
        on_group()
    max_running = server_config_from_args(args).max_running_requests
    with group, RankModel(group, args.model, placement_from_args(args), max_running=max_running,
                         prefill_chunk=args.chunked_prefill_size, max_total_tokens=args.max_total_tokens,
                         dynamic=dynamic_from_args(args) if leads else None, progress=leads,
                         cpu=cpu_from_args(args), page_size=args.page_size,
                         prefix_cache=not args.no_prefix_cache, attention_backend=args.attention_backend) as ranked:
        if not leads:
            freeze_startup_heap()  # a collection here stalls every rank's step, as on rank 0
            ranked.follow()
            return 0
        state = build_state(args, ranked.llm)
        ranked.leader.on_failure = state.service.fail
        ranked.leader.start()  # the followers are listening from now on: keep them alive while idle
        cpu_experts = int(((ranked.hybrid.assignment == -1) & ranked.hybrid.spec.moe_row_mask()[:, None]).sum())
        print(f"rank 0 of {env.world_size}: {int(ranked.hybrid.rank_mask.sum())} GPU experts here, "
              f"{cpu_experts} on the CPU tier (this rank only)", flush=True)
        serve(state)
    return 0


def _leader_signals(rank: int) -> None:
    def stop(signum, frame):
        raise KeyboardInterrupt  # unwinds through the finally blocks that remove the shared-memory files

    signal.signal(signal.SIGTERM, stop)  # uvicorn installs its own handlers while it serves


def _follower_signals(rank: int) -> None:
    seen = []

    def wait_for_rank_0(signum, frame):
        if seen:
            raise KeyboardInterrupt
        seen.append(signum)
        print(f"rank {rank}: waiting for rank 0 to stop the run (signal again to stop this rank now)",
              file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, wait_for_rank_0)
    signal.signal(signal.SIGTERM, wait_for_rank_0)
