"""How many torch ops a piece of code dispatches: what a CPU decode step's host time is made of (each op costs the
host a few microseconds whatever its size). Tests bound op counts with it, and benchmarks report them."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """`with OpCounter() as c: ...`, then `c.ops` (all aten ops dispatched on this thread, views included) and
    `c.names` (a Counter by op name, e.g. `c.names["index_select"]`)."""

    def __init__(self):
        super().__init__()
        self.names: Counter[str] = Counter()

    @property
    def ops(self) -> int:
        return sum(self.names.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
