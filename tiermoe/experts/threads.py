"""How many threads the CPU tier uses, and which CPUs they are pinned to.

Default: one thread per physical core, less one core for the caller (the thread that runs the model: Python,
attention, launching GPU kernels), and at least one. On a 2-core machine that is 1: the caller keeps a core of its
own, so it never waits for a core while the experts hold both. With a real GPU tier the caller mostly launches
kernels and then blocks in sync(), so `--cpu-threads 2` can be faster on 2 cores when the CPU part dominates;
measure it with benchmarks/bench_cpu_experts.py (it reports 1 and 2 threads).

Pinning: member i of a team of n is pinned to the i-th of the *last* n physical cores (one logical CPU each,
SMT siblings left alone), so the caller's scheduler-chosen core is most often the first core, outside the team.
TIERMOE_CPU_PIN=0 turns pinning off (e.g. when several processes share the machine).
"""

from __future__ import annotations

import os
from pathlib import Path


def physical_cpus() -> list[int]:
    """One logical CPU id per physical core this process may run on (lowest sibling), sorted."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    seen, out = set(), []
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            core = ("", str(cpu))  # no topology (containers, other OSes): treat every logical CPU as a core
        if core not in seen:
            seen.add(core)
            out.append(cpu)
    return out


def default_threads() -> int:
    return max(1, len(physical_cpus()) - 1)


def team_cpus(n: int) -> list[int]:
    """CPUs to pin a team of `n` to, or [] (no pinning) when disabled or there are fewer cores than threads."""
    if os.environ.get("TIERMOE_CPU_PIN", "1") == "0":
        return []
    cores = physical_cpus()
    return cores[len(cores) - n:] if n <= len(cores) else []
