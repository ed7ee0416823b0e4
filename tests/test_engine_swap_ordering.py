"""Tier swaps on a burst (kt-dynamic after a large prefill): bytes in flight stay within the budget, every
promotion allocates only after its demotion freed the GPU memory, destinations are allocated on the compute
stream and the side stream waits for it before copying (issue 20).

The CUDA stream path of the copier runs on the CPU with a recorder in place of CudaStreams: it logs every
allocation with the stream current at the time, every wait and event, and keeps the events unlanded until the
test lands them, one step at a time. GPU-tier memory is followed tensor by tensor (weakref finalizers).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import pytest
import torch

from tiermoe.config import PlacementConfig
from tiermoe.distributed.swaps import RankSwap, apply_swaps
from tiermoe.engine.placement_manager import PlacementManager
from tiermoe.experts.copier import AsyncCopier
from tiermoe.model.loader import load_hybrid_model
from tiermoe.placement.policies import Swap


class FakeEvent:
    def __init__(self, rec):
        self.rec, self.done = rec, False

    def record(self, stream):
        self.rec.log.append(("record", stream))
        self.rec.events.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class StreamRecorder:
    """CudaStreams' methods, on the CPU, with a log; tracks the bytes of GPU-tier tensors alive."""

    def __init__(self):
        self.log: list[tuple] = []
        self.events: list[FakeEvent] = []
        self.current = "compute"
        self.move = None  # (layer, expert, to_gpu) of the copy being started
        self.gpu_live = 0
        self.gpu_peak = 0

    def compute(self):
        return "compute"

    def side(self):
        return "side"

    @contextmanager
    def on(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def empty(self, like, device, pin):
        t = torch.empty(like.shape, dtype=like.dtype)
        layer, expert, to_gpu = self.move
        self.log.append(("alloc", self.current, layer, expert, to_gpu))
        if to_gpu:
            self.follow_gpu(t, layer, expert)
        return t

    def follow_gpu(self, t: torch.Tensor, layer: int, expert: int) -> None:
        self.gpu_live += t.nbytes
        self.gpu_peak = max(self.gpu_peak, self.gpu_live)
        weakref.finalize(t, self._freed, t.nbytes, layer, expert)

    def _freed(self, nbytes, layer, expert):
        self.gpu_live -= nbytes
        self.log.append(("free", layer, expert))

    def wait_stream(self, waiter, waited):
        self.log.append(("wait", waiter, waited))

    def event(self):
        return FakeEvent(self)

    def used_by(self, t, stream):
        self.log.append(("used_by", stream))

    def land_all(self) -> None:
        for e in self.events:
            e.done = True


class Burst:
    """Swap the first three GPU experts of every layer for three CPU experts, proposed again at every step
    (the manager must not start a swap twice)."""

    name = "burst"

    def __init__(self, mask):
        self.swaps = []
        for layer in range(mask.shape[0]):
            gpu, cpu = mask[layer].nonzero().flatten().tolist(), (~mask[layer]).nonzero().flatten().tolist()
            if gpu:
                self.swaps += [Swap(layer, i, o) for i, o in zip(cpu[:3], gpu[:3])]

    def observe(self, *args):
        pass

    def propose(self, mask, busy):
        return list(self.swaps)


@pytest.fixture
def hybrid(tiny_dir):
    with load_hybrid_model(tiny_dir("qwen3_moe"), PlacementConfig(num_gpu_experts=3), gpu_device="cpu",
                           dtype=torch.float32, progress=False) as hybrid:
        yield hybrid


def _watch(hybrid, rec: StreamRecorder) -> None:
    for layer, block in hybrid.blocks.items():
        for e in list(block.gpu_tier.experts):
            for t in block.gpu_tier.get(e).tensors():
                rec.follow_gpu(t, layer, e)
        start = block.start_move

        def tagged(expert, to_gpu, copier, layer=layer, start=start):
            rec.move = (layer, expert, to_gpu)
            return start(expert, to_gpu, copier)

        block.start_move = tagged


def test_a_burst_of_swaps_stays_within_the_in_flight_budget_and_frees_before_it_allocates(hybrid):
    ids = torch.tensor([[5, 9, 13, 40, 41, 42, 60, 61]])
    before_logits, before_mask = hybrid(input_ids=ids).logits, hybrid.mask
    rec = StreamRecorder()
    _watch(hybrid, rec)
    baseline = rec.gpu_live
    policy = Burst(before_mask)
    assert len(policy.swaps) >= 6
    copy_bytes = hybrid.spec.bytes_per_expert(hybrid.expert_dtype)
    manager = PlacementManager(hybrid, policy, AsyncCopier(streams=rec), max_bytes_in_flight=2 * copy_bytes)
    for _ in range(10 * len(policy.swaps)):
        manager.after_step()
        assert len(manager.in_flight) * copy_bytes <= manager.max_bytes_in_flight
        rec.land_all()  # what landed by the next step
        if not (manager.in_flight or manager.queued or manager.demoted):
            break
    manager.close()

    assert manager.swaps_started == len(policy.swaps) and manager.copies_landed == 2 * len(policy.swaps)
    after = hybrid.mask
    for s in policy.swaps:
        assert after[s.layer, s.expert_in] and not after[s.layer, s.expert_out]
    assert (after.sum(dim=1) == before_mask.sum(dim=1)).all()
    # peak GPU-tier expert memory during the burst: never above what it held before (demotions free first)
    assert rec.gpu_peak - baseline <= manager.max_bytes_in_flight
    assert rec.gpu_peak == baseline
    log = rec.log
    for s in policy.swaps:
        frees = [i for i, e in enumerate(log) if e == ("free", s.layer, s.expert_out)]
        allocs = [i for i, e in enumerate(log) if e[0] == "alloc" and e[2:] == (s.layer, s.expert_in, True)]
        assert frees and allocs and max(frees) < min(allocs), f"promotion of {s} allocated before its demotion freed"
    allocs = [i for i, e in enumerate(log) if e[0] == "alloc"]
    assert {log[i][1] for i in allocs} == {"compute"}  # destinations come from the compute stream's pool
    records = [i for i, e in enumerate(log) if e[0] == "record"]
    assert len(records) == 2 * len(policy.swaps) and {log[i][1] for i in records} == {"side"}
    for a, r in zip(allocs, records):  # each copy: allocate, then the side stream waits, then copies and records
        assert ("wait", "side", "compute") in log[a:r]
    assert sum(1 for e in log if e == ("used_by", "side")) == 2 * 2 * 2 * len(policy.swaps)  # dest + source
    torch.testing.assert_close(hybrid(input_ids=ids).logits, before_logits, rtol=1e-5, atol=1e-5)


def test_rank_swaps_free_the_demoted_expert_before_the_promoted_one_lands(hybrid):
    """Several ranks apply swaps synchronously: each GPU rank too drops before it copies, one swap at a time."""
    layer = next(iter(hybrid.blocks))
    block = hybrid.blocks[layer]
    gpu = block.gpu_tier
    swaps = [RankSwap(layer, i, o, rank=0) for i, o in zip(sorted(block.cpu_tier.experts)[:3], sorted(gpu.experts)[:3])]
    held, order = len(gpu), []
    add, pop = gpu.add, gpu.pop
    gpu.add = lambda e, w: (order.append(("add", e)), add(e, w), held_max.append(len(gpu)))
    gpu.pop = lambda e: (order.append(("pop", e)), pop(e))[1]
    held_max = []

    class Store:
        slots = {}

        def write(self, layer, expert, weights):
            self.slots[expert] = weights.to("cpu")
            return self.slots[expert]

        def slot(self, layer, expert):
            return self.slots[expert]

        def release(self, layer, expert):
            pass

    class Share:
        rank, store, holds_cpu_tier, store_on_this_host = 0, Store(), True, True
        group = type("G", (), {"barrier": lambda self, what="": None})()

        def same_host(self, rank):
            return True

        def kept(self, layer):
            return False

    apply_swaps(hybrid, Share(), swaps)
    assert order == [x for s in swaps for x in (("pop", s.expert_out), ("add", s.expert_in))]
    assert max(held_max) == held  # never more GPU experts than before
