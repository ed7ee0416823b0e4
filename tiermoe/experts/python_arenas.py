"""Keep the blocks CPython frees through its arena allocator, so a loop that calls across a frame-stack chunk's
edge does not map and unmap memory on every call.

CPython (3.11 onwards) keeps each thread's Python frames in 16 KiB chunks taken from its arena allocator, which
is mmap/munmap. A chunk is freed as soon as the frame at its start returns, so a loop whose calls reach just past
a chunk's end maps a chunk and unmaps it again on every iteration (CPython issue gh-142183, fixed in 2026 by keeping
one chunk per thread in 3.13 and 3.14; 3.11 and 3.12 take security fixes only). Whether a loop sits on that edge depends only on how
deep the stack is when it runs, so the same code is fast in one process and slow in another. Each munmap of a
process with several threads also interrupts every core that runs one of them to flush its TLB. Measured on a
2-core VM with the test suite's Triton-interpreter tests: 283,000 map/unmap pairs in one 60 s test, 43% of the
box's time in the kernel with two test processes side by side, and the slowest test 70 s in the full suite against
14 s alone; with the cache, 9 s beside another test process.

`keep_frame_chunks()` puts a small cache in front of the allocator that was installed: up to 64 freed blocks of
at most 64 KiB are kept and handed out again. pymalloc's 1 MiB arenas pass through untouched, so memory freed by
Python objects still goes back to the system. The allocator is the process's (CPython has one), so this is
process-wide state by nature; installing it twice keeps the first.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

from tiermoe.experts.kernels import native_library

MAX_BLOCK = 64 << 10  # frame-stack chunks are 16 KiB (a frame needing more doubles it); arenas are 1 MiB
CAPACITY = 64  # at most 4 MiB kept; a thread that thrashes needs one or two


class _ArenaAllocator(ctypes.Structure):
    """CPython's PyObjectArenaAllocator (stable since 3.4)."""

    _fields_ = [("ctx", ctypes.c_void_p), ("alloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]


@dataclass(frozen=True)
class ArenaCache:
    """The installed cache: its native handle, to read its counts."""

    lib: ctypes.CDLL
    handle: int

    def counts(self) -> tuple[int, int]:
        """(blocks handed out again from the cache, blocks the allocator below had to make)."""
        reused, fresh = ctypes.c_long(), ctypes.c_long()
        self.lib.tm_arena_cache_counts(ctypes.c_void_p(self.handle), ctypes.byref(reused), ctypes.byref(fresh))
        return reused.value, fresh.value


def keep_frame_chunks() -> ArenaCache | None:
    """Install the cache in front of Python's arena allocator (once per process; later calls return the one
    installed). None where it cannot be: not CPython, or the native library is disabled or unavailable."""
    if sys.implementation.name != "cpython":
        return None
    lib = native_library()
    if lib is None:
        return None
    _declare(lib)
    current = _ArenaAllocator()
    ctypes.pythonapi.PyObject_GetArenaAllocator(ctypes.byref(current))
    ours = ctypes.cast(lib.tm_arena_cache_alloc, ctypes.c_void_p).value
    if current.alloc == ours:
        return ArenaCache(lib, current.ctx)
    handle = lib.tm_arena_cache_create(current.ctx, current.alloc, current.free, MAX_BLOCK, CAPACITY)
    cached = _ArenaAllocator(handle, ours, ctypes.cast(lib.tm_arena_cache_free, ctypes.c_void_p).value)
    # CPython copies the struct; blocks the previous allocator made are freed through the cache into it
    ctypes.pythonapi.PyObject_SetArenaAllocator(ctypes.byref(cached))
    return ArenaCache(lib, handle)


def _declare(lib: ctypes.CDLL) -> None:
    lib.tm_arena_cache_create.restype = ctypes.c_void_p
    lib.tm_arena_cache_create.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_int]
    lib.tm_arena_cache_counts.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_long),
                                          ctypes.POINTER(ctypes.c_long)]
    ctypes.pythonapi.PyObject_GetArenaAllocator.argtypes = [ctypes.POINTER(_ArenaAllocator)]
    ctypes.pythonapi.PyObject_GetArenaAllocator.restype = None
    ctypes.pythonapi.PyObject_SetArenaAllocator.argtypes = [ctypes.POINTER(_ArenaAllocator)]
    ctypes.pythonapi.PyObject_SetArenaAllocator.restype = None
