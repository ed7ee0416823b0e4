"""Which CUDA device each rank takes, and the `auto` budget measured on each rank's own GPU (issue 20).

CUDA is faked: torch.cuda.is_available / device_count / mem_get_info are monkeypatched, so these run anywhere.
"""

from __future__ import annotations

import pytest
import torch

import tiermoe.distributed.rank_model as rank_model
from tiermoe.arch import detect, load_config
from tiermoe.config import PlacementConfig
from tiermoe.distributed.group import RankEnv, check_local_ranks, rank_device
from tiermoe.distributed.rank_model import RankModel
from tiermoe.errors import TiermoeError
from tiermoe.model.plan_source import placement_target
from tiermoe.placement.budget import GIB
from tiermoe.placement.planner import make_plan


@pytest.fixture
def gpus(monkeypatch):
    """gpus(free_gib per device, total_gib=80): a machine with that many CUDA devices; returns the devices whose
    free memory was asked for, in order."""
    asked = []

    def install(free_gib: list[float], total_gib: float = 80.0):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(free_gib))

        def mem_get_info(device=None):
            index = torch.device(device).index
            asked.append(index)
            return int(free_gib[index] * GIB), int(total_gib * GIB)

        monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
        return asked

    return install


def _env(local_rank: int, ranks: int) -> RankEnv:
    return RankEnv(rank=local_rank, world_size=ranks, local_rank=local_rank, local_world_size=ranks, node_rank=0)


def test_one_rank_keeps_the_device_it_was_given(gpus):
    gpus([80, 80])
    assert rank_device("cuda:1", _env(0, 1)) == torch.device("cuda", 1)
    assert rank_device("cuda", _env(0, 1)) == torch.device("cuda", 0)


def test_several_ranks_count_their_devices_from_the_one_given(gpus):
    gpus([80, 80, 80])
    assert [rank_device("cuda:1", _env(r, 2)) for r in range(2)] == [torch.device("cuda", 1), torch.device("cuda", 2)]
    assert [rank_device("cuda", _env(r, 3)) for r in range(3)] == [torch.device("cuda", r) for r in range(3)]
    check_local_ranks(2, "cuda:1", "--num-gpus 2 starts 2 ranks")  # cuda:1 and cuda:2 exist
    with pytest.raises(TiermoeError, match=r"3 rank\(s\) on this machine need cuda:1..cuda:3, but it has 3 CUDA"):
        rank_device("cuda:1", _env(0, 3))
    with pytest.raises(TiermoeError, match="one per GPU from cuda:2 on, but this machine has 3 CUDA devices; use "
                                           "at most 1"):
        check_local_ranks(2, "cuda:2", "--num-gpus 2 starts 2 ranks")


def test_each_rank_measures_auto_on_its_own_gpu(gpus):
    asked = gpus([70, 20])
    auto = PlacementConfig(gpu_memory_gb="auto", num_gpus=2)
    assert rank_model.own_gpu_memory(auto, torch.device("cuda", 1)) == (20 * GIB, 4 * GIB)  # margin: 5% of 80
    assert asked == [1]
    assert rank_model.own_gpu_memory(PlacementConfig(gpu_memory_gb=10.0), torch.device("cuda", 1)) is None
    assert "needs a CUDA device" in rank_model.own_gpu_memory(auto, torch.device("cpu"))


def _room_for(target, experts: int, margin: int) -> int:
    """Free bytes with which exactly `experts` experts fit one GPU (the forward thread's cuBLAS workspaces)."""
    fixed = target.non_expert_bytes + 8192 * target.kv_bytes_per_token + (33 << 20) + margin
    return fixed + experts * target.bytes_per_expert


def test_the_gpu_with_the_least_room_sizes_every_rank(tiny_dir, gpus):
    target = placement_target(tiny_dir("qwen3_moe"))
    margin = 512 << 20
    big, small = _room_for(target, 20, margin), _room_for(target, 6, margin)
    auto = PlacementConfig(gpu_memory_gb="auto", num_gpus=2)
    plan = make_plan(auto, target, gpu_device="cuda:0", gpu_memory=[(big, margin), (small, margin)])
    assert plan.budget["total_gpu_experts"] == 2 * 6
    # planned by one process (tiermoe place): it measures the devices the ranks will take, from cuda:1 on
    asked = gpus([80, big / GIB, small / GIB], total_gib=8)  # margin: max(512 MiB, 5% of 8 GiB)
    plan = make_plan(auto, target, gpu_device="cuda:1")
    assert asked == [1, 2] and plan.budget["total_gpu_experts"] == 2 * 6


def test_rank_0_plans_with_every_ranks_own_measure(tiny_dir, gpus, tmp_path):
    path = tiny_dir("qwen3_moe")
    target = placement_target(path)
    margin = 512 << 20
    gpus([_room_for(target, 20, margin) / GIB, 80], total_gib=8)

    class TwoRanks:  # rank 0 of two; rank 1's GPU has room for 6 experts
        rank, world_size, device = 0, 2, torch.device("cuda", 0)

        def all_gather(self, obj, what=""):
            return [obj, (_room_for(target, 6, margin), margin)]

        def broadcast(self, obj, what=""):
            return obj

    ranked = RankModel.__new__(RankModel)
    ranked.group, ranked.model_dir, ranked._store = TwoRanks(), path, None
    auto = PlacementConfig(gpu_memory_gb="auto", num_gpus=2)
    try:
        setup = ranked._setup(auto, detect(load_config(path)), torch.float32, 4, tmp_path)
    finally:
        if ranked._store is not None:
            ranked._store.close()
    assert "error" not in setup, setup.get("error")
    assert setup["plan"].budget["total_gpu_experts"] == 2 * 6
    assert ranked._store is not None and ranked._store.pin  # slots copied to a GPU are page-locked
