"""Rank 0's side of every step: publish what the step feeds, so the other ranks run the same forwards.

Rank 0 owns the scheduler, the page tables (and the HTTP server). Before each step's forward it broadcasts a
StepPlan on the control group: the sequence ids, the tokens each feeds and its feed (past length and page tables,
in the forward's row order), and the expert swaps to apply first. Followers run the same forward on their own
pools; their MoE blocks meet rank 0's in the per-layer all-reduce, and only rank 0 samples.

While idle, rank 0 sends a heartbeat plan every `heartbeat_s` seconds from a thread, so a follower waiting for
the next step never reaches the collective timeout: the timeout then only fires when rank 0 is really gone.
The plan broadcast, the swaps that follow it, and heartbeats are serialised by one lock, and no heartbeat is
sent during a step (followers are inside its forwards then, not listening), so all ranks see the control
messages in the same order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from tiermoe.distributed.group import RankFailure, fatal_cause
from tiermoe.distributed.swaps import RankSwap, apply_swaps, assign_swaps
from tiermoe.layers.ragged_step import SeqFeed


@dataclass(frozen=True)
class StepPlan:
    kind: str  # "step" | "heartbeat" | "stop"
    seq_ids: tuple[int, ...] = ()
    inputs: tuple[tuple[int, ...], ...] = ()  # tokens each sequence feeds, in seq_ids order (the forward's rows)
    feeds: tuple[SeqFeed, ...] = ()  # each sequence's past and page tables, in seq_ids order
    swaps: tuple[RankSwap, ...] = ()


def heartbeat_interval(timeout_s: float) -> float:
    """Often enough that several heartbeats fit in one collective timeout."""
    return min(5.0, max(0.05, timeout_s / 5))


class Leader:
    """Rank 0's publisher: `engine.leader`. Call start() once the followers are listening, close() at the end."""

    def __init__(self, share, hybrid, heartbeat_s: float | None = None):
        self.share = share
        self.group = share.group
        self.hybrid = hybrid
        self.heartbeat_s = heartbeat_s or heartbeat_interval(self.group.timeout_s)
        self.on_failure: Callable[[RankFailure], None] | None = None  # e.g. stop the server
        self.failure: RankFailure | None = None
        self.steps = 0
        self.heartbeats = 0
        self._lock = threading.Lock()
        self._in_step = False
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._heartbeats, name="tiermoe-heartbeat", daemon=True)
            self._thread.start()

    @contextmanager
    def step(self, seq_ids: list[int], inputs: list[list[int]], feeds: list[SeqFeed]):
        """Publish one step (and apply the queued swaps on every rank); the body runs the step's forwards."""
        if self.failure is not None:
            raise self.failure
        self.start()
        with self._lock:
            swaps = tuple(assign_swaps(self.hybrid, self.share.take_swaps()))
            plan = StepPlan("step", tuple(seq_ids), tuple(tuple(x) for x in inputs), tuple(feeds), swaps)
            self._send(plan, "publishing a step")
            self._in_step = True
            try:
                apply_swaps(self.hybrid, self.share, list(swaps))
            except BaseException:
                self._in_step = False
                raise
        try:
            yield
        except BaseException as err:
            if fatal_cause(err) is None:
                # the followers ran (or wait inside) this step's collectives: the ranks are out of step for good
                self.failure = RankFailure(f"rank 0: a step failed ({type(err).__name__}: {err}); the other ranks "
                                           "cannot follow it")
                raise self.failure from err
            self.failure = fatal_cause(err)
            raise
        finally:
            self._in_step = False
            self._last = time.monotonic()
            self.steps += 1

    def close(self) -> None:
        """Tell the followers to stop (their follow() returns), then stop the heartbeats."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.failure is None and not self.group.failed:
                self._send(StepPlan("stop"), "stopping the followers")

    def _send(self, plan: StepPlan, what: str) -> None:
        try:
            self.group.broadcast(plan, what=what)
        except RankFailure as err:
            self.failure = err
            raise
        self._last = time.monotonic()

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_s / 2):
            with self._lock:
                if self._in_step or self._stop.is_set() or time.monotonic() - self._last < self.heartbeat_s:
                    continue
                try:
                    self._send(StepPlan("heartbeat"), "a heartbeat")
                except RankFailure as err:
                    if self.on_failure is not None:
                        self.on_failure(err)
                    return
                self.heartbeats += 1
