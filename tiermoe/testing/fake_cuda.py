"""A stand-in for the part of `torch.cuda` the GPU tier's host round trip uses (streams, events, the stream context,
cudaHostRegister through `cudart()`), for machines without CUDA: the classes that take a `cuda` namespace
(tiermoe.experts.stream_queues.CudaQueues and the copier's CudaStreams, tiermoe.experts.host_slab.HostSlab) run
their CUDA branches on the CPU with it, and every call is logged in order so a test can check what waits for what.

Log entries: ("stream", name) made, ("enter", name) / ("exit", name) of a stream context, ("record", event, stream),
("wait_event", stream, event), ("wait_stream", waiter, waited), ("synchronize", event),
("register", address, nbytes, flags), ("unregister", address). Events and streams are logged by their names
("e0", "e1", ...; "compute", "s1", ...).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field


@dataclass(eq=False)
class FakeStream:
    name: str
    cuda: FakeCuda

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait_event", self.name, event.name))

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.log.append(("wait_stream", self.name, other.name))


@dataclass(eq=False)
class FakeEvent:
    name: str
    cuda: FakeCuda
    landed: bool = False

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        self.cuda.log.append(("record", self.name, stream.name))
        self.landed = self.cuda.events_land

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.cuda.log.append(("synchronize", self.name))
        self.landed = True


@dataclass
class FakeCudart:
    cuda: FakeCuda
    register_error: int = 0  # what cudaHostRegister returns (0: success)

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.cuda.log.append(("register", address, nbytes, flags))
        return self.register_error

    def cudaHostUnregister(self, address: int) -> int:
        self.cuda.log.append(("unregister", address))
        return 0


@dataclass
class FakeCuda:
    """events_land: whether an event counts as landed once recorded (else only once synchronized)."""

    events_land: bool = True
    log: list[tuple] = field(default_factory=list)
    _current: list[FakeStream] = field(default_factory=list)
    _made: int = 0

    def __post_init__(self):
        self._current.append(FakeStream("compute", self))
        self.runtime = FakeCudart(self)

    def current_stream(self, device=None) -> FakeStream:
        return self._current[-1]

    def Stream(self, device=None) -> FakeStream:  # torch.cuda's name
        self._made += 1
        stream = FakeStream(f"s{self._made}", self)
        self.log.append(("stream", stream.name))
        return stream

    def Event(self) -> FakeEvent:  # torch.cuda's name
        self._made += 1
        return FakeEvent(f"e{self._made}", self)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        self.log.append(("enter", stream.name))
        self._current.append(stream)
        try:
            yield stream
        finally:
            self._current.pop()
            self.log.append(("exit", stream.name))

    def cudart(self) -> FakeCudart:
        return self.runtime
