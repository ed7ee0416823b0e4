"""Asynchronous expert copies between tiers: serving never waits for one.

`start(weights, device)` returns a ticket at once; `ticket.landed()` says (without blocking) whether the copy is
complete, and only then may the caller flip the mask. On CUDA the copy runs on a side stream, tracked with an
event; on a CPU gpu_device it runs on a worker thread. `copy_fn` can be replaced to slow copies down in tests.

Stream rules on CUDA (what makes a copy safe while the compute stream keeps running):
- the destination is allocated on the compute stream (the caller's current one), never on the side stream: the
  caching allocator hands out a block only to the stream it belongs to, so a copy allocated on the side stream
  would, once freed, return to a pool the compute stream never reuses, and a block the compute stream freed
  (a demoted expert) could never take a promoted one;
- the side stream waits for the compute stream before copying, so it never writes a block the compute stream
  may still read (a freed expert that queued kernels use) nor reads a source compute work still writes;
- both tensors are marked used by the side stream (record_stream), so freeing either before the copy lands
  cannot hand its memory to anyone while the copy runs.
The stream operations go through a `CudaStreams` object, which makes its CUDA calls through the `cuda` namespace
it is given: tests give a recorder with the same methods, or CudaStreams over tiermoe.testing.fake_cuda.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields

import torch

from tiermoe.experts.stream_queues import CudaQueues
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


class CudaStreams(CudaQueues):
    """The stream operations a copy needs, on one CUDA device (see the module docstring): CudaQueues' compute and
    side streams, plus allocation on the current stream and stream-to-stream ordering."""

    def empty(self, like: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
        """A destination like `like` on `device`, allocated on the current stream (page-locked on the host when
        `pin`)."""
        return torch.empty(like.shape, dtype=like.dtype, device=device, pin_memory=pin and device.type == "cpu")

    def wait_stream(self, waiter, waited) -> None:
        waiter.wait_stream(waited)

    def event(self):
        return self.cuda.Event()

    def used_by(self, t: torch.Tensor, stream) -> None:
        if t.is_cuda:
            t.record_stream(stream)


class AsyncCopier:
    """streams: where CUDA copies run (default: CudaStreams over `cuda` of the device involved); given, every copy
    takes the stream path, which lets tests check its ordering on the CPU."""

    def __init__(self, copy_fn: Callable[[ExpertWeights, torch.device, bool], ExpertWeights] = plain_copy,
                 streams=None, cuda=torch.cuda):
        self.copy_fn = copy_fn
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiermoe-copy")
        self._streams = streams
        self._cuda = cuda

    def start(self, weights: ExpertWeights, device: torch.device, pin: bool = False,
              out: ExpertWeights | None = None) -> CopyTicket:
        """Copy `weights` to `device` (host copies pinned when `pin`), into `out` when given (a destination the
        tier provides, e.g. a free slot of its pinned slab)."""
        device = torch.device(device)
        uses_cuda = device.type == "cuda" or weights.device.type == "cuda"
        if self._streams is not None or (uses_cuda and self.copy_fn is plain_copy):
            if self._streams is None:
                self._streams = CudaStreams(device if device.type == "cuda" else weights.device, self._cuda)
            return self._start_on_streams(weights, device, pin, out)
        return CopyTicket(future=self._pool.submit(_copy_into, self.copy_fn, weights, device, pin, out))

    def _start_on_streams(self, weights: ExpertWeights, device: torch.device, pin: bool,
                          out: ExpertWeights | None) -> CopyTicket:
        ops = self._streams
        compute, side = ops.compute(), ops.side()
        dest = out if out is not None else _map(weights, lambda t: ops.empty(t, device, pin))  # compute stream
        ops.wait_stream(side, compute)
        with ops.on(side):
            for d, s in zip(dest.tensors(), weights.tensors()):
                d.copy_(s, non_blocking=True)
            event = ops.event()
            event.record(side)
        for t in (*dest.tensors(), *weights.tensors()):
            ops.used_by(t, side)
        return CopyTicket(dest, event=event, source=weights)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _map(weights: ExpertWeights, fn) -> ExpertWeights:
    return ExpertWeights(*(None if t is None else fn(t) for t in (getattr(weights, f.name) for f in fields(weights))))


def _copy_into(copy_fn, weights: ExpertWeights, device: torch.device, pin: bool,
               out: ExpertWeights | None) -> ExpertWeights:
    if out is None:
        return copy_fn(weights, device, pin)
    landed = weights if copy_fn is plain_copy else copy_fn(weights, device, pin)  # a slow copy_fn still runs
    for d, s in zip(out.tensors(), landed.tensors()):
        d.copy_(s)
    return out
