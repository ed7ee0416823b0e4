"""Asynchronous expert copies between tiers: serving never waits for one.

`start(weights, device)` returns a ticket at once; `ticket.landed()` says (without blocking) whether the copy is
complete, and only then may the caller flip the mask. On CUDA the copy runs on its own stream from pinned host
memory and is tracked with an event; on a CPU gpu_device it runs on a worker thread. `copy_fn` can be replaced
to slow copies down in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tiermoe.experts.weights import ExpertWeights


class CopyTicket:
    def __init__(self, result: ExpertWeights | None = None, future: Future | None = None, event=None,
                 source: ExpertWeights | None = None):
        self._result, self._future, self._event = result, future, event
        # A CUDA copy reads `source` on a side stream: holding it here keeps its memory from being reused
        # before the copy lands (a tier may hand out a transient, e.g. an FP8 expert dequantised for the move).
        self._source = source

    def landed(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._event is None or self._event.query()

    def result(self) -> ExpertWeights:
        """The landed copy (waits if it has not landed: call landed() first where waiting is not allowed)."""
        if self._future is not None:
            return self._future.result()
        if self._event is not None:
            self._event.synchronize()
        return self._result


def plain_copy(weights: ExpertWeights, device: torch.device, pin: bool) -> ExpertWeights:
    return weights.to(device, pin=pin)


class AsyncCopier:
    def __init__(self, copy_fn: Callable[[ExpertWeights, torch.device, bool], ExpertWeights] = plain_copy):
        self.copy_fn = copy_fn
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiermoe-copy")
        self._stream = None

    def start(self, weights: ExpertWeights, device: torch.device, pin: bool = False) -> CopyTicket:
        device = torch.device(device)
        uses_cuda = device.type == "cuda" or weights.device.type == "cuda"
        if uses_cuda and self.copy_fn is plain_copy:
            cuda_device = device if device.type == "cuda" else weights.device
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=cuda_device)
            self._stream.wait_stream(torch.cuda.current_stream(cuda_device))
            with torch.cuda.stream(self._stream):
                landed = _non_blocking_copy(weights, device, pin)
                event = torch.cuda.Event()
                event.record(self._stream)
            return CopyTicket(landed, event=event, source=weights)
        return CopyTicket(future=self._pool.submit(self.copy_fn, weights, device, pin))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _non_blocking_copy(weights: ExpertWeights, device: torch.device, pin: bool) -> ExpertWeights:
    def move(t):
        if t is None:
            return None
        if device.type == "cpu":
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            return out.copy_(t, non_blocking=True)
        return t.to(device, non_blocking=True)

    return ExpertWeights(*(move(t) for t in (weights.gate_up, weights.down, weights.gate_up_bias,
                                                weights.down_bias)))
