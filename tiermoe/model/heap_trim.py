"""Handing the heap memory a load freed back to the operating system.

Loading reads every expert into a temporary buffer before its tier packs or quantises it; glibc's allocator keeps
most of those freed buffers in its arenas, so the process's resident memory after a load stays about a third of the
experts' bytes above what the tiers hold (1.5 GiB of 7.6 on a 4-layer Qwen3-30B-A3B-shaped checkpoint), memory
that nothing will use again but that the machine counts as taken. `malloc_trim(0)` returns it. Elsewhere (musl,
macOS) there is no such call and nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform


def return_freed_heap() -> bool:
    """Ask the C allocator to give freed heap pages back; True when it did (glibc only)."""
    if platform.system() != "Linux":
        return False
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
