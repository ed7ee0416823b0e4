"""Host memory of a process as proportional set size (PSS), the measure that does not double count sharing.

RSS counts every page a process maps, so N processes mapping one shared copy of the CPU experts would count it
N times; PSS charges each page 1/n to each of the n processes that map it, so the PSS of all ranks adds up to
the memory they really use together (shared-memory pages included, as Pss_Shmem). Linux only (smaps_rollup).
"""

from __future__ import annotations

import os
from pathlib import Path


def memory_rollup(pid: int | None = None) -> dict[str, int]:
    """Bytes by smaps_rollup field (Rss, Pss, Pss_Anon, Pss_File, Pss_Shmem, ...) of process `pid` (default: this)."""
    path = Path(f"/proc/{pid or os.getpid()}/smaps_rollup")
    out = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def pss_bytes(pid: int | None = None) -> int:
    """Proportional set size of process `pid` (default: this one), in bytes."""
    return memory_rollup(pid)["Pss"]
