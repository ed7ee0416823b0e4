"""A follower rank's main loop: run rank 0's steps, on this rank's own KV caches, until rank 0 says stop.

Each StepPlan names the sequences of the step and the tokens they feed; the follower runs the same forwards
through its own Engine (so its MoE blocks meet rank 0's in every layer's all-reduce) and drops the logits:
sampling happens on rank 0 only. A follower never decides anything, so it cannot drift from rank 0.
"""

from __future__ import annotations

from tiermoe.distributed.group import fatal_cause
from tiermoe.distributed.swaps import apply_swaps


class _Cache:
    """What Engine.forward_batch needs of a sequence on a follower: its KV cache."""

    cache = None


def follow(engine, share) -> int:
    """Run rank 0's steps until it stops; returns the number of steps run. Raises RankFailure if rank 0 dies or
    stops answering (no step and no heartbeat within the collective timeout)."""
    caches: dict[int, _Cache] = {}
    steps = 0
    while True:
        plan = share.group.broadcast(what="waiting for rank 0's next step")
        if plan.kind == "stop":
            return steps
        if plan.kind != "step":
            continue  # a heartbeat: rank 0 is alive and idle
        try:
            apply_swaps(engine.hybrid, share, list(plan.swaps))
            live = set(plan.live) | set(plan.seq_ids)
            for seq_id in [i for i in caches if i not in live]:
                del caches[seq_id]  # finished or aborted on rank 0: free its KV cache here too
            seqs = [caches.setdefault(i, _Cache()) for i in plan.seq_ids]
            engine.forward_batch(seqs, [list(x) for x in plan.inputs])
        except Exception as err:
            cause = fatal_cause(err)
            if cause is not None:
                raise cause from None
            raise
        steps += 1
