"""How many threads the CPU tier uses, and which CPUs they are pinned to.

Default: one thread per physical core, less one core for the caller (the thread that runs the model: Python,
attention, launching GPU kernels), and at least one. Measured on this 2-core machine with all experts on the CPU
tier (benchmarks/bench_e2e_cpu.py, 2026-12-02; docs/benchmarks-history.md, "CPU-only end to end: re-run after the
host-time work"): the 48-layer model of width 128 decoded 35.9 tokens/s with this default (1 thread) and 6.3 with
`--cpu-threads 2` (torch's own threads and the team's spin on the same two cores), the 2-layer Qwen3-30B-A3B-shaped
one 18.6 and 19.2. So the caller keeps its core even when it has no experts to compute, as long as torch computes
beside the team. A CPU-only run of a bf16 model computes its non-expert linears on the team too, and there the team
takes every core and torch one thread during a step (tiermoe.model.cpu_only, `torch_threads` below). `--cpu-threads`
overrides both.

Pinning: member i of a team of n is pinned to the i-th of the *last* n physical cores (one logical CPU each,
SMT siblings left alone), so the caller's scheduler-chosen core is most often the first core, outside the team.
TIERMOE_CPU_PIN=0 turns pinning off (e.g. when several processes share the machine).

NUMA pools (`--kt-numa-nodes 0 1`, kt-kernel's thread pools): the team is split into one pool per listed node as
kt-kernel splits it (n // pools threads each, the first n % pools one more), and each pool is pinned to the last
physical cores of its node; pools listed on the same node take distinct cores. Only the threads are placed: the
experts' memory stays where the loader put it (kt-kernel also splits the weights per node).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tiermoe.errors import TiermoeError

SYSFS = Path("/sys/devices/system")  # the topology's root; tests point it at a fake machine


def allowed_cpus() -> list[int]:
    """The logical CPUs this process may run on, sorted, as they were when first asked (`_first_affinity`)."""
    return list(_first_affinity())


@functools.cache
def _first_affinity() -> tuple[int, ...]:
    """Read once per process: a kernel team pins its calling thread to one CPU on its first job, and a thread's
    affinity is what sched_getaffinity reports, so asked again from that thread it would name one CPU, and a team
    made later (another thread count, a second model) would see one core and start its helpers on the caller's.
    The first question comes before any team exists (making one asks which CPUs to pin to)."""
    if not hasattr(os, "sched_getaffinity"):
        return tuple(range(os.cpu_count() or 1))
    return tuple(sorted(os.sched_getaffinity(0)))


def physical_cpus(allowed: list[int] | None = None) -> list[int]:
    """One logical CPU id per physical core among `allowed` (default: all this process may run on), lowest
    sibling first, sorted."""
    seen, out = set(), []
    for cpu in allowed_cpus() if allowed is None else allowed:
        topo = SYSFS / "cpu" / f"cpu{cpu}" / "topology"
        try:
            core = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            core = ("", str(cpu))  # no topology (containers, other OSes): treat every logical CPU as a core
        if core not in seen:
            seen.add(core)
            out.append(cpu)
    return out


def default_threads() -> int:
    """The team size when --cpu-threads is not given (see the module docstring)."""
    return max(1, len(physical_cpus()) - 1)


def team_cpus(n: int) -> list[int]:
    """CPUs to pin a team of `n` to, or [] (no pinning) when disabled or there are fewer cores than threads."""
    if os.environ.get("TIERMOE_CPU_PIN", "1") == "0":
        return []
    cores = physical_cpus()
    return cores[len(cores) - n:] if n <= len(cores) else []


def _cpu_list(text: str) -> list[int]:
    """The kernel's CPU list format: "0-3,8-11" -> [0, 1, 2, 3, 8, 9, 10, 11]."""
    cpus = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def numa_nodes() -> dict[int, list[int]]:
    """NUMA node id -> the logical CPUs of that node this process may run on; {0: all of them} where the kernel
    reports no nodes (containers without sysfs, other OSes)."""
    allowed = set(allowed_cpus())
    nodes = {}
    for path in sorted((SYSFS / "node").glob("node[0-9]*")):
        try:
            nodes[int(path.name[4:])] = sorted(allowed & set(_cpu_list((path / "cpulist").read_text())))
        except (OSError, ValueError):
            continue
    return nodes or {0: sorted(allowed)}


def pool_sizes(threads: int, pools: int) -> list[int]:
    """kt-kernel's split of `threads` over `pools`: threads // pools each, the first threads % pools one more."""
    return [threads // pools + (1 if i < threads % pools else 0) for i in range(pools)]


def numa_team_cpus(n: int, nodes: tuple[int, ...] | list[int]) -> list[int]:
    """CPUs for a team of `n` split into one pool per entry of `nodes` (pool order, pool 0 first), or [] when
    pinning is turned off. A node that is missing or too small for its pools is a TiermoeError."""
    if n < len(nodes):
        raise TiermoeError(f"--kt-numa-nodes lists {len(nodes)} pools for {n} CPU-tier threads: every pool needs a "
                           f"thread (raise --cpu-threads / --kt-cpuinfer)")
    present = numa_nodes()
    missing = sorted({node for node in nodes if node not in present})
    if missing:
        raise TiermoeError(f"--kt-numa-nodes: no NUMA node {', '.join(map(str, missing))} on this machine (it has "
                           f"{', '.join(map(str, sorted(present)))})")
    if os.environ.get("TIERMOE_CPU_PIN", "1") == "0":
        return []
    sizes = pool_sizes(n, len(nodes))
    wanted = {node: sum(s for s, m in zip(sizes, nodes) if m == node) for node in set(nodes)}
    free = {}
    for node, count in wanted.items():
        cores = physical_cpus(present[node])
        if count > len(cores):
            raise TiermoeError(f"--kt-numa-nodes: node {node} has {len(cores)} physical cores for {count} threads "
                               f"({n} threads in {len(nodes)} pools); lower --cpu-threads or list the node less often")
        free[node] = cores[len(cores) - count:]
    cpus = []
    for size, node in zip(sizes, nodes):
        cpus.extend(free[node][:size])
        free[node] = free[node][size:]
    return cpus


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the block, then restored (None: left as they are). OpenMP keeps
    the count per calling thread, so a server's engine thread sets its own; a toggle costs under a microsecond."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
