"""Python's frame-stack chunks are kept for reuse (tiermoe.experts.python_arenas): a loop whose calls cross a
chunk's edge maps no new memory per call once the cache is in front of the arena allocator."""

from __future__ import annotations

import pytest

from tiermoe.experts.python_arenas import keep_frame_chunks


def descend(depth: int) -> int:
    """Each frame carries locals enough that a few hundred of them span several 16 KiB chunks."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = depth
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 if depth == 0 else descend(depth - 1)


def test_a_loop_across_chunk_edges_reuses_the_freed_chunks():
    cache = keep_frame_chunks()
    if cache is None:
        pytest.skip("the native library is unavailable here")
    assert keep_frame_chunks().handle == cache.handle  # installed once per process
    descend(400)  # the chunks this depth needs exist once
    reused0, fresh0 = cache.counts()
    for _ in range(50):
        descend(400)
    reused, fresh = cache.counts()
    # every descent frees its deeper chunks on the way back and takes them again on the next one
    assert reused - reused0 >= 50
    # without the cache each of those would be a new mapping; other threads may map a few of their own
    assert fresh - fresh0 <= 5
