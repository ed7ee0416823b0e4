"""Two queues of device work (compute, and a side queue for copies) and the events that order them.

The layerwise-prefill streamer issues its copies and computes through this small interface, so one code path
serves CUDA (two streams, events) and the host (work runs as it is issued: nothing to order), and a test can
log the order with fakes. The expert copier's CudaStreams and the MoE layer's host ring build on these queues. A
stream here is whatever `compute()` / `side()` return; an event is what `record` returns and `wait` / `wait_host`
take. CudaQueues makes every CUDA call through the `cuda` namespace it is given (torch.cuda, or
tiermoe.testing.fake_cuda's stand-in, with which the suite runs these branches on a machine without CUDA).
"""

from __future__ import annotations

import contextlib

import torch


class HostQueues:
    """The main device is the host: every op has finished when it returns, so no ordering is needed."""

    def compute(self):
        return None

    def side(self):
        return None

    def on(self, stream):
        return contextlib.nullcontext()

    def record(self, stream):
        return None

    def wait(self, stream, event) -> None:
        pass

    def wait_host(self, event) -> None:
        pass


class CudaQueues:
    """The caller's current stream computes; one side stream (made on first use) copies."""

    def __init__(self, device: torch.device, cuda=torch.cuda):
        self.device = device
        self.cuda = cuda
        self._side = None

    def compute(self):
        return self.cuda.current_stream(self.device)

    def side(self):
        if self._side is None:
            self._side = self.cuda.Stream(self.device)
        return self._side

    def on(self, stream):
        return self.cuda.stream(stream)

    def record(self, stream):
        event = self.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def wait_host(self, event) -> None:
        """The host waits until `event` (recorded on a stream) has been reached."""
        event.synchronize()


def queues_for(device: torch.device):
    return CudaQueues(device) if device.type == "cuda" else HostQueues()
