"""`tiermoe serve` as one rank of a multi-rank run: rank 0 serves HTTP, the other ranks follow its steps.

Signals: Ctrl-C in a terminal reaches every rank at once, and torchrun forwards SIGTERM to every rank. Rank 0
drains its requests (which needs the followers until the end) and then stops them; so a follower ignores the
first SIGINT or SIGTERM and waits for rank 0's stop message, and only a second signal ends it at once.
Rank 0 turns SIGTERM into a clean exit while loading, so its shared-memory files are removed.
"""

from __future__ import annotations

import signal
import sys

from tiermoe.distributed.group import RankEnv, RankGroup, rank_device
from tiermoe.distributed.rank_model import RankModel


def serve_rank(args, env: RankEnv, on_group=None) -> int:
    """Run `tiermoe serve` as rank `env.rank`. `on_group()` is called once the process group is up."""
    from tiermoe.cli.cpu_flags import cpu_from_args
    from tiermoe.cli.placement_flags import dynamic_from_args, placement_from_args
    from tiermoe.cli.serve_cmd import build_state, serve

    device = rank_device(args.gpu_device, env)
    leads = env.rank == 0
    (_leader_signals if leads else _follower_signals)(env.rank)
    group = RankGroup(env, device, args.dist_timeout)
    if on_group is not None:
        on_group()
    with group, RankModel(group, args.model, placement_from_args(args), max_running=args.max_running_requests,
                         prefill_chunk=args.chunked_prefill_size, max_total_tokens=args.max_total_tokens,
                         dynamic=dynamic_from_args(args) if leads else None, progress=leads,
                         cpu=cpu_from_args(args)) as ranked:
        if not leads:
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
