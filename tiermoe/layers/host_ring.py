"""A MoE layer's page-locked staging for the CPU tier's round trip: the inputs in, the result out, allocated once.

Without it each MoE layer of each step makes a pageable packed copy to the host (a blocking `.to("cpu")` into
fresh memory: the driver stages it through a bounce buffer), a fresh result tensor on the worker, and then pins
that result (a page-locking allocation) to copy it back without a wait. Here each layer keeps DEPTH slots of
page-locked memory, grown only when a step needs more rows than any before:
- in: the inputs (hidden states, expert ids, routing weights) packed on the device are copied into the slot with
  `non_blocking`, and the host waits on an event recorded after that copy: the layer's one wait, as before, now
  without a pageable transfer;
- out: the CPU kernels write the result straight into the slot's output buffer, which goes back to the device with
  `non_blocking`; an event recorded after that copy is waited on before the slot's buffer is written again, DEPTH
  uses later (a step later at least: long done).
On a CPU main device nothing crosses (HybridMoE.crosses_to_host is False) and this is not used. With the host-sync
counter (tiermoe.testing.host_syncs) it runs on the CPU device as it would on CUDA, minus the page-locking; the events
go through the device's queues (tiermoe.experts.stream_queues), which a test gives CUDA's calls faked on the CPU.
"""

from __future__ import annotations

import torch

from tiermoe.experts.stream_queues import queues_for

DEPTH = 2  # slots per layer: a slot is written again only after the other one was used


class HostRing:
    def __init__(self, device: torch.device, depth: int = DEPTH, queues=None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.queues = queues if queues is not None else queues_for(self.device)
        self._in: list[torch.Tensor | None] = [None] * depth  # uint8, page-locked on CUDA
        self._out: list[torch.Tensor | None] = [None] * depth
        self._out_read: list = [None] * depth  # event after the copy that reads the slot's output buffer
        self._slot = 0
        self.allocations = 0  # buffers made so far (tests: none per step once warm)

    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Host views of `tensors`, made with ONE device-to-host copy into this slot's input buffer (their bytes
        packed, widest elements first so every part stays aligned for its dtype) and one wait for it."""
        order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
        packed = torch.cat([tensors[i].contiguous().reshape(-1).view(torch.uint8) for i in order])
        staged = self._buffer(self._in, packed.numel())[:packed.numel()]
        staged.copy_(packed, non_blocking=self.cuda)
        # the layer's one wait: the CPU tier reads these bytes next
        self.queues.wait_host(self.queues.record(self.queues.compute()))
        out: list[torch.Tensor | None] = [None] * len(tensors)
        offset = 0
        for i in order:
            t = tensors[i]
            nbytes = t.numel() * t.element_size()
            out[i] = staged[offset:offset + nbytes].view(t.dtype).view(t.shape)
            offset += nbytes
        return out

    def result(self, like: torch.Tensor) -> torch.Tensor:
        """This slot's output buffer, shaped and typed like `like` [T, D], for the CPU tier to write into."""
        read = self._out_read[self._slot]
        if read is not None:
            self.queues.wait_host(read)  # the copy that read this buffer DEPTH uses ago (done by now, in practice)
        nbytes = like.numel() * like.element_size()
        return self._buffer(self._out, nbytes)[:nbytes].view(like.dtype).view(like.shape)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """`host` (this slot's output buffer) on the device without the host waiting; the slot is then done."""
        on_device = host.to(self.device, non_blocking=True)  # page-locked on CUDA: the host goes on at once
        self._out_read[self._slot] = self.queues.record(self.queues.compute())
        self._slot = (self._slot + 1) % len(self._in)
        return on_device

    def _buffer(self, buffers: list, nbytes: int) -> torch.Tensor:
        held = buffers[self._slot]
        if held is None or held.numel() < nbytes:
            with torch.inference_mode(False):  # a buffer that inference and no-grad forwards alike write into
                held = buffers[self._slot] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.cuda)
            self.allocations += 1
        return held
