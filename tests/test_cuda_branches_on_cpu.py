"""The branches only the CUDA path takes in the expert tiers and the MoE host round trip, run on the CPU with
CUDA's stream, event and cudaHostRegister calls faked (tiermoe.testing.fake_cuda): what each waits for, and in
which order. The few CUDA calls that cannot run here are the reviewed list in docs/architecture.md, which
test_the_reviewed_list_names_lines_that_exist keeps true."""

from __future__ import annotations

import gc
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tiermoe.errors import TiermoeError
from tiermoe.experts.copier import AsyncCopier, CudaStreams
from tiermoe.experts.host_slab import HostSlab, expert_shapes
from tiermoe.experts.stream_queues import CudaQueues
from tiermoe.experts.weights import ExpertWeights
from tiermoe.layers.host_ring import HostRing
from tiermoe.testing.fake_cuda import FakeCuda

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def expert(seed: int = 0, h: int = 4, i: int = 3) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(torch.randn(2 * i, h, generator=g), torch.randn(h, i, generator=g))


def test_queues_make_one_side_stream_and_order_through_events():
    cuda = FakeCuda()
    queues = CudaQueues(CPU, cuda)
    compute, side = queues.compute(), queues.side()
    assert queues.side() is side and compute.name == "compute"  # the side stream is made once
    with queues.on(side):
        assert queues.compute() is side  # inside the context the side stream is current
        ready = queues.record(side)
    queues.wait(compute, ready)
    queues.wait_host(ready)
    assert cuda.log == [("stream", "s1"), ("enter", "s1"), ("record", "e2", "s1"), ("exit", "s1"),
                        ("wait_event", "compute", "e2"), ("synchronize", "e2")]


def test_a_copy_allocates_on_compute_waits_for_it_copies_on_the_side_stream_and_lands_by_its_event():
    cuda = FakeCuda(events_land=False)
    copier = AsyncCopier(streams=CudaStreams(CPU, cuda))
    source = expert()
    ticket = copier.start(source, CPU)
    assert cuda.log == [("stream", "s1"), ("wait_stream", "s1", "compute"), ("enter", "s1"),
                        ("record", "e2", "s1"), ("exit", "s1")]
    assert not ticket.landed()  # the event has not been reached: the mask may not flip yet
    landed = ticket.result()  # waits for it
    assert cuda.log[-1] == ("synchronize", "e2") and ticket.landed()
    assert all(torch.equal(a, b) for a, b in zip(landed.tensors(), source.tensors()))
    copier.close()


def test_a_copy_to_a_cuda_device_takes_the_stream_path_by_default_and_fills_the_given_slot():
    cuda = FakeCuda()
    copier = AsyncCopier(cuda=cuda)
    source, slot = expert(1), ExpertWeights(torch.zeros(6, 4), torch.zeros(4, 3))
    ticket = copier.start(source, torch.device("cuda"), out=slot)
    assert ticket.landed() and ticket.result() is slot and torch.equal(slot.down, source.down)
    assert ("wait_stream", "s1", "compute") in cuda.log  # the CudaStreams it made itself ran the copy
    copier.close()


def test_a_slow_copy_into_a_given_slot_lands_there():
    calls = []

    def slow_copy(weights, device, pin):
        calls.append(device)
        return weights.to(device, pin=pin)

    copier = AsyncCopier(slow_copy)
    source, slot = expert(2), ExpertWeights(torch.zeros(6, 4), torch.zeros(4, 3))
    assert copier.start(source, CPU, out=slot).result() is slot
    assert calls == [CPU] and torch.equal(slot.gate_up, source.gate_up)
    copier.close()


def test_a_copy_to_another_device_copies_every_tensor():
    moved = expert(3).to("meta")  # any non-host device takes the device copy
    assert all(t.device.type == "meta" for t in moved.tensors())


def test_a_pinned_slab_is_registered_once_and_unregistered_when_it_goes():
    gpt_oss = SimpleNamespace(hidden_size=4, expert_intermediate_size=3, expert_bias=True)
    assert expert_shapes(gpt_oss) == [(6, 4), (4, 3), (6,), (4,)]
    cuda = FakeCuda()
    slab = HostSlab(expert_shapes(gpt_oss)[:2], torch.float32, slots=2, pin=True, cuda=cuda)
    address, nbytes = slab.flat.data_ptr(), slab.nbytes
    assert cuda.log == [("register", address, nbytes, 1)]  # portable: every context of the process
    tier = {}
    first = slab.take(7, tier)
    assert slab.holds(first) and not slab.holds(expert())
    assert slab.take(8, tier) is not None
    assert slab.take(9, tier) is None  # both slots reserved for copies that have not landed
    del slab, first
    gc.collect()
    assert cuda.log[-1] == ("unregister", address)


def test_a_refused_registration_says_what_to_raise():
    cuda = FakeCuda()
    cuda.runtime.register_error = 1
    with pytest.raises(TiermoeError, match=r"cudaHostRegister error 1.*ulimit -l"):
        HostSlab([(6, 4)], torch.float32, slots=1, pin=True, cuda=cuda)


def test_the_host_ring_waits_for_its_input_copy_and_reuses_an_output_only_after_its_copy_back():
    cuda = FakeCuda()
    ring = HostRing(CPU, depth=2, queues=CudaQueues(CPU, cuda))
    events = []
    for step in range(3):
        x = torch.randn(2, 4)
        (hx,) = ring.to_host(x)
        assert torch.equal(hx, x)
        start = len(cuda.log)
        out = ring.result(hx)
        if step == 2:  # slot 0 again: its output buffer's copy back (step 0's) is waited on first
            assert cuda.log[start:] == [("synchronize", events[0])]
        ring.to_device(out.copy_(x))
        events.append(cuda.log[-1][1])
    ins = [e for e in cuda.log if e[0] == "record"]
    assert len(ins) == 6  # per step: the event after the input copy (then waited on), the one after the copy back
    assert all(cuda.log[cuda.log.index(r) + 1] == ("synchronize", r[1]) for r in ins[0::2])


REVIEWED = re.compile(r"^\| `(tiermoe/[\w/]+\.py)` \| `(.+)` \|", re.MULTILINE)


def test_the_reviewed_list_names_lines_that_exist():
    """docs/architecture.md lists the CUDA-only calls no test here can execute: each must still be a line of the
    file it names, and the list stays within 15 lines."""
    rows = REVIEWED.findall((ROOT / "docs/architecture.md").read_text())
    assert 0 < len(rows) <= 15
    for path, code in rows:
        lines = [line.strip() for line in (ROOT / path).read_text().splitlines()]
        assert code in lines, f"{path} has no line `{code}`"
