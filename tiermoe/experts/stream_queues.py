"""Two queues of device work (compute, and a side queue for copies) and the events that order them.

The layerwise-prefill streamer issues its copies and computes through this small interface, so one code path
serves CUDA (two streams, events) and the host (work runs as it is issued: nothing to order), and a test can
log the order with fakes. The expert copier's CudaStreams builds on CudaQueues. A stream here is whatever `compute()` / `side()` return; an event is what `record`
returns and `wait` takes.
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


class CudaQueues:
    """The caller's current stream computes; one side stream (made on first use) copies."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side = None

    def compute(self):
        return torch.cuda.current_stream(self.device)

    def side(self):
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def on(self, stream):
        return torch.cuda.stream(stream)

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        stream.wait_event(event)


def queues_for(device: torch.device):
    return CudaQueues(device) if device.type == "cuda" else HostQueues()
