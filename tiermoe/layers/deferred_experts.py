"""Deferred experts (`--kt-max-deferred-experts-per-token d`, kt-kernel's approximation; opt-in, 0 = exact).

Per token, the K - d routed slots with the largest routing weights are computed in their own layer; the CPU-tier
experts among the other d slots are computed as a second job on the CPU worker, and their weighted sum is added
to the NEXT MoE layer's output instead of this one's. The job then runs while the main device computes the next
layer's attention and router, and the layer's own CPU job is smaller. The price: the next layer's attention and
router do not see those experts' contribution (the error is measured in benchmarks/bench_deferred_experts.py).
The last MoE layer defers nothing, so every contribution reaches the output; GPU-tier experts are never deferred.

Unlike kt-kernel, which protects an expert for the whole batch when any token ranks it in its top K - d, the
split is per token, so a sequence's output does not depend on which sequences share its step.
"""

from __future__ import annotations

from concurrent.futures import Future, wait

import torch


def split_deferred(cpu_ids_TK: torch.Tensor, weights_TK: torch.Tensor, deferred: int):
    """(now_TK, later_TK): `cpu_ids_TK` (-1 where the slot is not the CPU tier's) split by routing weight.

    Per token the K - `deferred` slots of largest weight (ties: the earlier slot, as the router ordered them)
    stay in `now`; the CPU slots among the others go to `later`. Each slot is in exactly one of the two."""
    k = cpu_ids_TK.shape[1]
    keep = max(k - deferred, 0)
    order_TK = weights_TK.argsort(dim=1, descending=True, stable=True)
    kept_TK = torch.zeros_like(cpu_ids_TK, dtype=torch.bool).scatter_(1, order_TK[:, :keep], True)
    return cpu_ids_TK.masked_fill(~kept_TK, -1), cpu_ids_TK.masked_fill(kept_TK, -1)


class DeferredExperts:
    """The model's deferred-expert hand-over between consecutive MoE layers of one forward (one per model).

    A layer `take`s the job the previous MoE layer deferred (a Future of y_TD on the host) and `put`s its own.
    A job left by a forward that stopped midway is found stale by the next forward's first MoE layer (it was not
    put by this layer's predecessor) and drained, so an aborted step never leaks into the next one."""

    def __init__(self, per_token: int, moe_layers):
        if per_token < 1:
            raise ValueError(f"deferred experts per token must be >= 1 (0 means no DeferredExperts), got {per_token}")
        layers = sorted(moe_layers)
        self.per_token = per_token
        self._previous = dict(zip(layers[1:], layers[:-1]))  # MoE layer -> the MoE layer before it
        self._last = layers[-1]
        self._job: Future | None = None
        self._from: int | None = None

    def defers(self, layer: int) -> bool:
        """Whether `layer` defers any experts (the last MoE layer does not: nothing would add them)."""
        return layer != self._last

    def take(self, layer: int) -> Future | None:
        """The job the MoE layer before `layer` deferred to it (None if none); drains a stale one."""
        job, source = self._job, self._from
        self._job = self._from = None
        if job is not None and source != self._previous.get(layer):
            wait([job])  # a stopped forward's job: let it end before anything else touches its tier
            return None
        return job

    def put(self, layer: int, job: Future | None) -> None:
        """`layer`'s deferred job (None: nothing deferred in this step), for the next MoE layer to add."""
        self.drain()
        self._job, self._from = job, (layer if job is not None else None)

    def drain(self) -> None:
        """Drop a pending job after it ends (a failed forward, or a tier swap about to release weights)."""
        job, self._job, self._from = self._job, None, None
        if job is not None:
            wait([job])
