"""Page-locked CPU-tier memory: nothing pinned for a host GPU tier, one slab per layer (not one block per expert)
for a CUDA one, nothing for a backend that copies its experts away, and swaps reuse the slab's slots (issue 20).

No CUDA here: a pinned allocation raises on this machine, so the spies below count the would-be pinned
allocations (torch.empty(pin_memory=True), Tensor.pin_memory) and the cudaHostRegister calls instead.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tiermoe.model.loader as loader
from tiermoe.arch import detect, load_config
from tiermoe.config import CPUConfig
from tiermoe.experts.native import NativeCPUExperts
from tiermoe.model.loader import load_hybrid_model


class PinCounter(TorchFunctionMode):
    """Counts the pinned allocations torch is asked for (torch.empty(pin_memory=True) and the like,
    Tensor.pin_memory) and makes them unpinned. A mode, not a patched torch.empty: torch.device("meta") keeps
    the constructors it redirects in a cache, which a patched function would poison for the whole session."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("pin_memory"):
            self.seen["pinned_empty"] += 1
            kwargs["pin_memory"] = False
        if func is torch.Tensor.pin_memory:
            self.seen["pin_memory"] += 1
            return args[0]
        return func(*args, **kwargs)


@pytest.fixture
def pins(monkeypatch):
    """Counts of every way host memory gets page-locked; allocations proceed unpinned, cudaHostRegister is faked."""
    seen = {"pinned_empty": 0, "pin_memory": 0, "register": []}
    # by name, so that a tree without the module fails each test here rather than the whole file at import
    monkeypatch.setattr("tiermoe.experts.host_slab.register_host",
                        lambda address, nbytes, cuda=None: seen["register"].append(nbytes))
    monkeypatch.setattr("tiermoe.experts.host_slab.unregister_host", lambda address, cuda=None: None)
    with PinCounter(seen):
        yield seen


@pytest.fixture
def counted(monkeypatch):
    """The PinCounter alone (for what any tree must satisfy)."""
    seen = {"pinned_empty": 0, "pin_memory": 0, "register": []}
    with PinCounter(seen):
        yield seen


def _mask(spec):
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    mask[list(spec.moe_layers), :2] = True
    return mask


def _spec(path):
    return detect(load_config(path))


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_host_gpu_tier_pins_nothing_even_where_cuda_exists(tiny_dir, counted, monkeypatch, backend):
    path = tiny_dir("qwen3_moe")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with load_hybrid_model(path, _mask(_spec(path)), gpu_device="cpu", dtype=torch.float32, progress=False,
                           cpu=CPUConfig(backend=backend)) as hybrid:
        assert all(len(b.cpu_tier) > 0 for b in hybrid.blocks.values())
    assert counted == {"pinned_empty": 0, "pin_memory": 0, "register": []}


def test_a_cuda_gpu_tier_pins_one_slab_per_layer_with_experts_as_views(tiny_dir, pins, monkeypatch):
    path = tiny_dir("qwen3_moe")
    spec = _spec(path)
    reference = _logits(path, spec)
    monkeypatch.setattr(loader, "pins_host_memory", lambda device: True, raising=False)  # the GPU tier "on CUDA"
    with load_hybrid_model(path, _mask(spec), gpu_device="cpu", dtype=torch.float32, progress=False,
                           cpu=CPUConfig(backend="torch")) as hybrid:
        per_expert = spec.bytes_per_expert(torch.float32)
        cpu_experts = spec.num_experts - 2
        assert pins["register"] == [cpu_experts * per_expert] * len(spec.moe_layers)  # once per layer, exact bytes
        assert pins["pinned_empty"] == 0 and pins["pin_memory"] == 0  # no expert pinned on its own
        for block in hybrid.blocks.values():
            slab = block.cpu_tier.host_slab
            assert slab.nbytes == cpu_experts * per_expert and slab.pinned
            for e in block.cpu_tier.experts:
                assert all(slab.flat.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                           for t in block.cpu_tier.get(e).tensors())
        torch.testing.assert_close(hybrid(input_ids=IDS).logits, reference, rtol=1e-5, atol=1e-5)

        # swaps reuse the slots: the promoted expert's slot takes the next demoted one, nothing new is pinned
        layer = spec.moe_layers[0]
        block = hybrid.blocks[layer]
        promoted = sorted(block.cpu_tier.experts)[0]
        slot_address = block.cpu_tier.get(promoted).gate_up.data_ptr()
        hybrid.move_experts(layer, [promoted], to_gpu=True)
        hybrid.move_experts(layer, [0], to_gpu=False)
        assert block.cpu_tier.get(0).gate_up.data_ptr() == slot_address
        assert len(pins["register"]) == len(spec.moe_layers) and pins["pinned_empty"] == 0
        torch.testing.assert_close(hybrid(input_ids=IDS).logits, reference, rtol=1e-5, atol=1e-5)


def test_a_backend_that_copies_its_experts_away_gets_nothing_pinned(tiny_dir, pins, monkeypatch):
    path = tiny_dir("qwen3_moe")
    monkeypatch.setattr(loader, "pins_host_memory", lambda device: True, raising=False)
    with load_hybrid_model(path, _mask(_spec(path)), gpu_device="cpu", dtype=torch.bfloat16, progress=False,
                           cpu=CPUConfig(backend="native", expert_dtype="int8")) as hybrid:
        tiers = [b.cpu_tier for b in hybrid.blocks.values()]
        assert all(isinstance(t, NativeCPUExperts) and len(t) for t in tiers)
    assert pins == {"pinned_empty": 0, "pin_memory": 0, "register": []}


IDS = torch.tensor([[5, 9, 13, 40, 41, 42, 60, 61]])


def _logits(path, spec):
    with load_hybrid_model(path, _mask(spec), gpu_device="cpu", dtype=torch.float32, progress=False,
                           cpu=CPUConfig(backend="torch")) as hybrid:
        return hybrid(input_ids=IDS).logits
