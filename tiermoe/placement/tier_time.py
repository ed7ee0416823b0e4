"""A tier's time per MoE layer call: seconds = a x distinct experts + b x (token, expert) pairs + c per call.

A call reads each distinct expert once (a: weights read, per-expert dispatch), every routed pair costs math (b),
and every call a fixed amount (c; for the CPU tier the hand-off to its worker thread, paid whenever a layer's CPU
tier holds experts, even when no token routes to them). tiermoe.analysis.tier_time_fit measures a, b and c on a
machine; `assumed_cpu_tier` stands in where nothing was measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DEFAULT_CPU_READ_BANDWIDTH = 25e9  # bytes/s: a 2-core box measures 23-25 GB/s
DEFAULT_CPU_FLOPS = 4e11  # FLOP/s the CPU backend sustains on large batches


@dataclass(frozen=True)
class TierFit:
    per_expert: float  # a, seconds per distinct expert
    per_pair: float  # b, seconds per routed (token, expert) pair
    per_call: float  # c, seconds per call
    mean_relative_error: float  # of the fit on its own samples
    samples: int  # 0: assumed, not measured
    backend: str = ""  # the tier class measured

    def seconds(self, distinct, pairs, called):
        """Tensor-friendly: a x distinct + b x pairs + c x called."""
        return self.per_expert * distinct + self.per_pair * pairs + self.per_call * called

    def as_dict(self) -> dict:
        return asdict(self)


def assumed_cpu_tier(bytes_per_expert: int, flops_per_pair: float,
                     read_bandwidth: float = DEFAULT_CPU_READ_BANDWIDTH,
                     flops: float = DEFAULT_CPU_FLOPS) -> TierFit:
    """A CPU tier that reads an expert at `read_bandwidth` bytes/s and computes at `flops`, with no call cost."""
    return TierFit(bytes_per_expert / read_bandwidth, flops_per_pair / flops, 0.0, 0.0, 0,
                   backend=f"assumed: {read_bandwidth / 1e9:g} GB/s, {flops / 1e9:g} GFLOP/s")
