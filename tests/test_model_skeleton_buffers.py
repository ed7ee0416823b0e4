"""Every buffer of the non-expert part lives on the main device, non-persistent ones (rotary inv_freq) included:
one left on the host costs a host-to-device copy and a sync per forward, and breaks model code without `.to`.

Without CUDA the main device is the host, so placement is checked with the meta device as a stand-in main
device: anything the loader leaves behind stays visibly on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS
from torch import nn

import tiermoe.model.loader as loader
from tiermoe.model.skeleton import move_buffers


@pytest.mark.parametrize("arch", ARCHS)
def test_loader_puts_every_buffer_on_the_main_device(arch, tiny_dir, monkeypatch):
    # tensors loaded onto meta look unloaded to the completeness check, which is not what this test is about
    monkeypatch.setattr(loader, "_tie_and_check", lambda model, config: None)
    with loader.load_hybrid_model(tiny_dir(arch), None, gpu_device="meta", dtype=torch.float32,
                                  progress=False) as hybrid:
        buffers = dict(hybrid.model.named_buffers())
        assert buffers, "a model without buffers cannot show anything here"
        astray = {name: str(b.device) for name, b in buffers.items() if b.device != hybrid.gpu_device}
        assert not astray, f"buffers not on {hybrid.gpu_device}: {astray}"
        assert all(p.device == hybrid.gpu_device for p in hybrid.model.parameters())


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("unset", None)


def test_move_buffers_moves_persistent_and_non_persistent_ones_and_keeps_them_so():
    model = nn.Sequential(Rotary(), nn.Sequential(Rotary()))
    move_buffers(model, torch.device("meta"))
    assert {n: b.device.type for n, b in model.named_buffers()} == {
        "0.inv_freq": "meta", "0.scale": "meta", "1.0.inv_freq": "meta", "1.0.scale": "meta"}
    assert set(model.state_dict()) == {"0.scale", "1.0.scale"}  # non-persistent ones stay out of checkpoints
    assert model[0].inv_freq.dtype == torch.float32 and model[0].unset is None
