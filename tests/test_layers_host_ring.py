"""The CPU tier's round trip through a layer's staging ring (tiermoe.layers.host_ring): one copy in, the CPU kernels'
result written straight into the ring, nothing allocated per step once warm, the same logits. Run on the CPU
device with the copies a GPU makes (as the host-sync counter runs it); page-locking and events need CUDA."""

from __future__ import annotations

import pytest
import torch
from conftest import make_mask

from tiermoe.arch import detect, load_config
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.layers.host_ring import HostRing

PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [30, 31, 32]]


def test_views_come_back_exact_and_buffers_are_reused_until_a_step_needs_more():
    ring = HostRing(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for tokens in (4, 3, 4, 2, 4, 3):  # slots used in turn: 4, 3 each time at most
        x, ids, w = torch.randn(tokens, 8, generator=g), torch.randint(0, 9, (tokens, 2)), torch.rand(tokens, 2)
        hx, hids, hw = ring.to_host(x, ids, w)
        assert torch.equal(hx, x) and torch.equal(hids, ids) and torch.equal(hw, w)
        out = ring.result(hx)
        assert out.shape == x.shape and out.dtype == x.dtype
        ring.to_device(out)
    assert ring.allocations == 4  # each of the two slots: its input and its output buffer, once
    ring.to_host(torch.randn(40, 8), torch.zeros(40, 2, dtype=torch.int64), torch.rand(40, 2))
    assert ring.allocations == 5  # a bigger step grows the slot it uses


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_a_step_that_crosses_to_the_host_allocates_nothing_once_warm_and_gives_the_same_tokens(tiny_dir, backend):
    from tiermoe.config import CPUConfig

    path = tiny_dir("qwen3_moe")
    mask = make_mask("random_half", detect(load_config(path)))
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(path, placement=mask, dtype=torch.float32, cpu=CPUConfig(backend=backend), progress=False) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
        blocks = list(llm.hybrid.blocks.values())
        for block in blocks:
            block.crosses_to_host = True  # the copies a GPU main device makes
        written = []
        for block in blocks:
            sync = block.cpu_tier.sync
            block.cpu_tier.sync = lambda sync=sync: written.append(sync()) or written[-1]
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
        warm = [b.host_ring.allocations for b in blocks]
        again = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
        assert [b.host_ring.allocations for b in blocks] == warm  # the same step sizes: no buffer made
    assert got == want and again == want
    rings = {b.host_ring._out[s].data_ptr() for b in blocks for s in range(2) if b.host_ring._out[s] is not None}
    assert written and all(y.data_ptr() in rings for y in written)  # the kernels wrote into the ring itself
