"""A follower rank's main loop: run rank 0's steps, on this rank's own KV pool, until rank 0 says stop.

Each StepPlan names the step's feeds (every sequence's past length, new tokens and page tables, in the row order of
rank 0's forward) and the tokens; the follower runs the same forward on its own pool (sized as rank 0's, so the
same pages hold the same tokens), so its MoE blocks meet rank 0's in every layer's all-reduce, and runs its LM
head on no row: sampling happens on rank 0 only. A follower never decides anything, so it cannot drift from
rank 0.
"""

from __future__ import annotations

from tiermoe.distributed.group import fatal_cause
from tiermoe.distributed.swaps import apply_swaps


def follow(engine, share) -> int:
    """Run rank 0's steps until it stops; returns the number of steps run. Raises RankFailure if rank 0 dies or
    stops answering (no step and no heartbeat within the collective timeout)."""
    steps = 0
    while True:
        plan = share.group.broadcast(what="waiting for rank 0's next step")
        if plan.kind == "stop":
            return steps
        if plan.kind != "step":
            continue  # a heartbeat: rank 0 is alive and idle
        try:
            apply_swaps(engine.hybrid, share, list(plan.swaps))
            engine.forward_feeds(list(plan.feeds), [list(x) for x in plan.inputs], ["none"] * len(plan.feeds))
        except Exception as err:
            cause = fatal_cause(err)
            if cause is not None:
                raise cause from None
            raise
        steps += 1
