"""A server's start-up heap leaves the garbage collector's generations (issue: serving under hostile load): once the
model and the app are built, `gc.freeze()` moves them to the permanent generation, so a full collection while
serving walks what serving made, not the ~400,000 objects of start-up (0.26-0.76 s pauses of every thread in the
adversarial soak before)."""

from __future__ import annotations

import gc

from tiermoe.server.gc_freeze import freeze_startup_heap


class Loaded:
    """Stands for what start-up builds: tracked objects that stay alive."""


def test_objects_alive_at_start_up_are_left_out_of_later_collections():
    loaded = [Loaded() for _ in range(1000)]
    before = len(gc.get_objects())
    try:
        frozen = freeze_startup_heap()
        # the collector now walks none of them (gc.get_objects lists the three generations it collects)
        assert frozen >= 1000 and len(gc.get_objects()) < before - 1000
        assert not any(isinstance(o, Loaded) for o in gc.get_objects())
        later = Loaded()
        assert any(o is later for o in gc.get_objects())  # what serving makes is still collected
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
    assert len(loaded) == 1000
