"""Cross-sequence batching of the MoE layers: one expert pass per layer for the whole batch.

Each forward of a step (one sequence's prompt chunk, or one batched decode of several sequences, see
batched_decode.py) runs the unmodified transformers forward on its own thread, with its own KV caches and
positions, so attention stays exactly per sequence whatever the architecture (MLA, linear attention, sliding
windows). At every HybridMoE block the threads meet: the last one to arrive concatenates all their tokens, runs
the block once (so each expert's weights are read once for all of them), and hands every thread its rows back.
Routing is per token, so each sequence gets what it would get alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import torch


class BatchAborted(RuntimeError):
    """Another sequence of the same step failed; this one stops too instead of waiting forever."""


class MoEBatcher:
    def __init__(self, max_threads: int):
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="tiermoe-seq")
        self._local = threading.local()
        self._cond = threading.Condition()
        self._parties = 0
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, object] = {}
        self._round = 0
        self._error: BaseException | None = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def participating(self) -> bool:
        return getattr(self._local, "index", None) is not None

    def run(self, jobs: list[Callable[[], object]]) -> list[object]:
        """Run `jobs` (one forward each) concurrently, meeting at every MoE block; results in order."""
        if len(jobs) == 1:
            return [jobs[0]()]
        with self._cond:
            self._parties, self._inputs, self._outputs, self._error = len(jobs), {}, {}, None
        futures = [self._pool.submit(self._participate, i, job) for i, job in enumerate(jobs)]
        # every job ends (a failed one stops the others at their next MoE block) before the next run() resets the
        # shared state; then the first failure, if any, is raised: the real error, not the BatchAborted it caused
        wait(futures)
        if self._error is not None:
            raise self._error
        return [f.result() for f in futures]

    def _participate(self, index: int, job: Callable[[], object]) -> object:
        self._local.index = index
        try:
            return job()
        except BaseException as err:
            with self._cond:
                self._error = self._error or err
                self._cond.notify_all()
            raise
        finally:
            self._local.index = None

    def exchange(self, compute: Callable[[torch.Tensor], object], hidden: torch.Tensor):
        """Called by a block inside `run`: contribute `hidden` [1, S, D], get back this sequence's output."""
        index = self._local.index
        with self._cond:
            if self._error is not None:
                raise BatchAborted("another sequence in this batch failed") from self._error
            my_round = self._round
            self._inputs[index] = hidden
            if len(self._inputs) < self._parties:
                self._cond.wait_for(lambda: self._round != my_round or self._error is not None)
                if self._round == my_round:
                    raise BatchAborted("another sequence in this batch failed") from self._error
                return self._outputs.pop(index)
            inputs = [self._inputs[i] for i in range(self._parties)]
            self._inputs = {}
        try:
            outputs = _split(compute(torch.cat([x.reshape(-1, x.shape[-1]) for x in inputs])[None]), inputs)
        except BaseException as err:
            with self._cond:
                self._error = err
                self._cond.notify_all()
            raise
        with self._cond:
            self._outputs = dict(enumerate(outputs))
            self._round += 1
            self._cond.notify_all()
            return self._outputs.pop(index)


def _split(output, inputs: list[torch.Tensor]) -> list[object]:
    """Cut a block output over the concatenated tokens back into one per input (tuples: each element)."""
    sizes = [x.shape[:-1].numel() for x in inputs]
    if isinstance(output, tuple):
        parts = [_split_tensor(t, sizes, inputs) for t in output]
        return [tuple(p[i] for p in parts) for i in range(len(inputs))]
    return _split_tensor(output, sizes, inputs)


def _split_tensor(t: torch.Tensor, sizes: list[int], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    rows = t.reshape(-1, t.shape[-1])
    pieces = torch.split(rows, sizes)
    if t.dim() == 3 and t.shape[-1] == inputs[0].shape[-1]:
        return [p.reshape(x.shape) for p, x in zip(pieces, inputs)]
    return list(pieces)
