"""Which cores the caller uses while the GPU tier runs on this CPU, so measured runs stay sane.

On a GPU machine the caller thread (Python, attention, kernel launches) and the CPU tier's threads are on the
CPU, and the GPU tier is elsewhere. With the GPU tier on the CPU device the caller computes it itself; the CPU
tier's native / kt team is pinned to the cores the caller does not use (tiermoe.experts.threads). torch's
intra-op pool would otherwise spread the caller's ops over every core, its parallel regions would wait for the
pinned CPU-tier thread, and a layer with both tiers would run far slower than the two alone. So while measuring,
the caller keeps to the cores left over. (The tiers still share caches and memory bandwidth: how their times
combine on one CPU is measured, see pass_cost and host_cost_fit.) The torch backend computes the CPU tier in torch's
own pool: nothing to split.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from tiermoe.config import CPUConfig
from tiermoe.experts.threads import default_threads, physical_cpus


@dataclass(frozen=True)
class CoreSplit:
    cores: int
    cpu_tier_threads: int | None  # None: the CPU tier uses torch's pool
    caller_threads: int  # torch intra-op threads of the caller while measuring

    def as_dict(self) -> dict:
        return asdict(self)


def core_split(cpu: CPUConfig) -> CoreSplit:
    cores = len(physical_cpus())
    if cpu.backend == "torch":
        return CoreSplit(cores, None, torch.get_num_threads())
    tier = cpu.threads or default_threads()
    return CoreSplit(cores, tier, max(1, cores - tier))


@contextmanager
def caller_threads(split: CoreSplit) -> Iterator[CoreSplit]:
    """Run the block with torch's intra-op threads set to the caller's share; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(split.caller_threads)
    try:
        yield split
    finally:
        torch.set_num_threads(before)
