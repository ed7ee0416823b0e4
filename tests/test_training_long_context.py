"""Long training contexts: the CPU tier's part of a MoE layer computes in spans of `expert_chunk` tokens, forward and
backward (tiermoe.layers.routed_autograd), with the gradients of the whole context (fp32, 1e-6 per tensor), and what
its backward holds beyond its outputs follows the span, not the context. Held bytes are counted from the CPU
allocator's events (torch.profiler, profile_memory): the torch tier computes everything on the calling thread, so
the profiler sees every allocation of the backward.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_mask
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from training_reference import (
    adapter_grads,
    lora_config,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
)

from tiermoe.arch import detect, load_config
from tiermoe.config import CPUConfig
from tiermoe.errors import TiermoeError
from tiermoe.experts.kernels import supported_isa
from tiermoe.layers.routed_autograd import RoutedExperts, token_chunks
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.long_context import set_expert_chunk
from tiermoe.training.lora import apply_lora

pytest.importorskip("peft")

TOL = 1e-6
CPU_TIERS = ["torch", pytest.param("bf16", marks=pytest.mark.skipif(supported_isa() is None,
                                                                      reason="the kernel library cannot be built"))]


def _load(path, cpu_tier: str):
    cpu = CPUConfig() if cpu_tier == "torch" else CPUConfig(expert_dtype=cpu_tier)
    return load_hybrid_model(path, make_mask("all_cpu", detect(load_config(path))), gpu_device="cpu",
                             dtype=torch.float32, cpu=cpu, progress=False, trainable=True)


def test_token_chunks_cover_the_context_in_order():
    assert token_chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert token_chunks(10, 0) == token_chunks(10, 10) == token_chunks(10, 64) == [(0, 10)]


def _layer_call(block, tokens: int, seed: int):
    """(inputs needing gradients, run(chunk) -> the layer's output) for one CPU-tier call of `block` on random rows."""
    E, D, K = len(block.assignment_E), block.lora_experts.gate_up_A.shape[-1], 2
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=g, requires_grad=True)
    w = torch.rand(tokens, K, generator=g, requires_grad=True)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    factors = block.lora_experts.factors()

    def run(chunk: int) -> torch.Tensor:
        return RoutedExperts.apply(x, w, ids, block.cpu_tier, block.gpu_tier.act, block.lora_experts.scalings, chunk,
                                   *factors)

    return (x, w, *factors), run


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("cpu_tier", CPU_TIERS)
def test_chunked_cpu_experts_give_the_gradients_of_the_whole_context(tiny_dir, cpu_tier):
    """A layer's CPU-tier part on 96 tokens in spans of 16 against all at once: its output, input gradient,
    routing-weight gradient and every expert-LoRA gradient within 1e-6 per tensor (products of fewer rows may sum
    in another order: fp32 rounding, not a different computation); then a whole model's LoRA gradients with spans
    of 8 tokens against none, where the rounding passes through attention's backward too (1e-5)."""
    path = tiny_dir("qwen3_moe")
    with _load(path, cpu_tier) as hybrid:
        model = apply_lora(hybrid, lora_config())
        block = next(iter(hybrid.blocks.values()))
        leaves, run = _layer_call(block, 96, seed=1)
        results = []
        for chunk in (0, 16):
            for t in leaves:
                t.grad = None
            y = run(chunk)
            y.backward(torch.ones_like(y) + y.detach())
            results.append([y.detach(), *(t.grad.clone() for t in leaves)])
        for ref, got in zip(*results):
            assert _relative(got, ref) <= TOL

        ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(5))  # 48 tokens: 6 spans of 8
        grads = {}
        for chunk in (0, 8):
            set_expert_chunk(hybrid, chunk)
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            grads[chunk] = {k: g.clone() for k, g in adapter_grads(model).items()}
    assert any(k.startswith("layer.") for k in grads[0])
    assert max(_relative(grads[8][k], g) for k, g in grads[0].items()) <= 1e-5


def _held_bytes(run) -> int:
    """The most bytes the CPU allocator held at once during run() beyond what it still holds after (its outputs)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()

    def walk(events):
        for e in events:
            yield e
            yield from walk(e.children)

    sizes = [e.extra_fields.alloc_size for e in sorted(walk(prof.profiler.kineto_results.experimental_event_tree()),
                                                       key=lambda e: e.start_time_ns) if e.tag == _EventType.Allocation]
    net = peak = 0
    for n in sizes:
        net += n
        peak = max(peak, net)
    return peak - net


def test_what_the_cpu_tier_backward_holds_follows_the_chunk_not_the_context(tiny_dir):
    with _load(tiny_dir("qwen3_moe"), "torch") as hybrid:
        apply_lora(hybrid, lora_config())  # gives the layer its expert LoRA
        block = next(iter(hybrid.blocks.values()))

        def held(tokens: int, chunk: int) -> int:
            leaves, run = _layer_call(block, tokens, seed=tokens)
            for t in leaves:
                t.grad = None
            y = run(chunk)
            gy = torch.randn_like(y)
            return _held_bytes(lambda: y.backward(gy))

        at_16, at_32, at_64 = held(256, 16), held(256, 32), held(256, 64)
        assert abs(held(128, 16) - at_16) <= 0.05 * at_16  # a longer context holds no more
        per_16_tokens = at_32 - at_16
        assert per_16_tokens > 0 and abs((at_64 - at_16) - 3 * per_16_tokens) <= 0.25 * 3 * per_16_tokens
        assert held(256, 0) > 2 * at_16  # all at once, it holds the whole context's rows


def test_a_bad_chunk_is_refused_in_one_line(tiny_dir):
    with _load(tiny_dir("qwen3_moe"), "torch") as hybrid:
        for bad in (-1, 2.5, "8"):
            with pytest.raises(TiermoeError, match="number of tokens >= 0"):
                set_expert_chunk(hybrid, bad)
