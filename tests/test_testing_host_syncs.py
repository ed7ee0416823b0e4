"""The would-be host sync counter (tiermoe.testing.host_syncs) flags what would stall the host on a GPU, and
nothing that stays on the host, on the CPU path where host and device are the same torch device."""

from __future__ import annotations

import pytest
import torch

from tiermoe.testing.host_syncs import OUTSIDE, HostSyncCounter


def device_tensors():
    """Tensors the counter did not see made: they count as device memory (parameters, caches, inputs)."""
    return torch.tensor([[0, 2], [1, -1]]), torch.randn(4, 3)


CASES = {
    "nonzero": lambda ids, x: ids.nonzero(),
    "where(cond)": lambda ids, x: torch.where(ids == 1),
    "unique": lambda ids, x: torch.unique(ids),
    "boolean mask": lambda ids, x: ids[ids >= 0],
    "masked_select": lambda ids, x: ids.masked_select(ids > 0),
    "repeat_interleave": lambda ids, x: x.repeat_interleave(torch.ones(4, dtype=torch.long, device=x.device), dim=0),
    "item": lambda ids, x: ids[0, 0].item(),
    "bool": lambda ids, x: bool(ids[0, 0] > 0),
    "tolist": lambda ids, x: ids.tolist(),
    "cpu": lambda ids, x: x.cpu(),
    "to cpu": lambda ids, x: x.to("cpu"),
    "copy_ into host": lambda ids, x: torch.empty(4, 3).copy_(x),
    "tensor from data on the device": lambda ids, x: torch.tensor([1, 2], device=x.device),
    "host tensor to the device": lambda ids, x: torch.ones(2).to(x.device),
}


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_each_kind_of_sync_is_flagged_once(case, inference):
    ids, x = device_tensors()
    with torch.inference_mode(inference), HostSyncCounter() as counter:
        CASES[case](ids, x)
    assert counter.count(OUTSIDE) == 1, counter.describe()


def test_host_side_work_and_async_copies_are_not_counted():
    ids, x = device_tensors()
    with torch.inference_mode(), HostSyncCounter() as counter:
        host_ids = ids.to("cpu")  # one copy to the host ...
        host_ids.tolist(), host_ids.nonzero(), torch.unique(host_ids), host_ids[host_ids >= 0]  # ... then host work
        torch.tensor([3, 1]).sort().values.tolist()
        torch.ones(3, pin_memory=False).to(x.device, non_blocking=True)  # listed apart: need not wait
        x * 2 + x.sum()  # device work that never reaches the host
    assert counter.count(OUTSIDE) == 1, counter.describe()
    assert [what for _, what in counter.async_copies] == ["non_blocking host-to-device copy .to()"]


def test_the_source_of_a_copy_stays_on_the_device():
    """On the CPU `.to("cpu")` returns its input itself: the source must not become host memory by it."""
    ids, _ = device_tensors()
    with HostSyncCounter() as counter:
        host = ids.to("cpu")
        ids.tolist()
        host.tolist()
    assert counter.count(OUTSIDE) == 2, counter.describe()  # the copy, and reading the device tensor
