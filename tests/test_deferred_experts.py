"""Deferred experts (--kt-max-deferred-experts-per-token d): per token the d lowest-weighted CPU-tier slots of a
MoE layer are added in the next MoE layer instead, the last MoE layer defers nothing, GPU-tier experts are never
deferred, and d = 0 stays exact.

The reference is the unmodified transformers model with a hook on every MoE block that moves the deferred slots'
contribution (computed by the block's own fused experts, other slots' weights zeroed) from that layer's output to
the next MoE layer's: fp32, within 1e-5 of tiermoe's deferred run.
"""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference, make_mask, rel_err

from tiermoe.arch import detect, load_config
from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.layers.deferred_experts import split_deferred
from tiermoe.model.loader import load_hybrid_model
from tiermoe.model.skeleton import decoder_layers, moe_block_attr

FP32_TOL = 1e-5
IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 61, 7, 128, 33, 90, 12]])


def test_split_keeps_the_heaviest_slots_per_token_and_never_defers_another_tier():
    cpu_ids = torch.tensor([[4, 7, -1, 2], [1, 3, 5, 6], [0, 9, 8, -1]])
    weights = torch.tensor([[0.1, 0.4, 0.05, 0.45], [0.25, 0.25, 0.25, 0.25], [0.3, 0.1, 0.2, 0.4]])
    now, later = split_deferred(cpu_ids, weights, 2)
    assert now.tolist() == [[-1, 7, -1, 2], [1, 3, -1, -1], [0, -1, -1, -1]]  # ties: the router's earlier slot
    assert later.tolist() == [[4, -1, -1, -1], [-1, -1, 5, 6], [-1, 9, 8, -1]]  # slot 3 of token 2: GPU tier
    assert torch.equal(split_deferred(cpu_ids, weights, 0)[0], cpu_ids)
    assert torch.equal(split_deferred(cpu_ids, weights, 4)[1], cpu_ids)  # d = K: every CPU slot deferred


def _reference_logits(path, deferred: int, on_gpu_LE: torch.Tensor) -> torch.Tensor:
    """transformers' logits with each MoE layer's deferred slots added by the next MoE layer instead."""
    model = load_reference(path)
    layers = [(i, getattr(layer, moe_block_attr(layer))) for i, layer in enumerate(decoder_layers(model))
              if moe_block_attr(layer) is not None]
    last = layers[-1][0]
    carried = {"y": None}

    def hook(layer, block, args, output):
        x_TD = args[0].reshape(-1, args[0].shape[-1])
        _, weights_TK, ids_TK = block.gate(x_TD)
        later = torch.zeros_like(output.reshape(x_TD.shape))
        if layer != last:
            cpu_ids_TK = ids_TK.masked_fill(on_gpu_LE[layer][ids_TK], -1)
            deferred_TK = split_deferred(cpu_ids_TK, weights_TK, deferred)[1] >= 0
            later = block.experts(x_TD, ids_TK, weights_TK * deferred_TK)
        y = output.reshape(x_TD.shape) - later
        if carried["y"] is not None:
            y = y + carried["y"]
        carried["y"] = later
        return y.reshape(output.shape)

    for layer, block in layers:
        block.register_forward_hook(lambda b, a, o, layer=layer: hook(layer, b, a, o))
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("arch,mask_kind,deferred", [("qwen3_moe", "all_cpu", 1), ("qwen3_moe", "random_half", 2),
                                                     ("deepseek_v3", "random_half", 1)])
def test_deferred_run_equals_transformers_with_the_contribution_moved_to_the_next_moe_layer(arch, mask_kind,
                                                                                           deferred, tiny_dir):
    path = tiny_dir(arch)
    mask = make_mask(mask_kind, detect(load_config(path)))
    want = _reference_logits(path, deferred, mask)
    exact = load_reference(path)(IDS).logits.detach()
    with load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False,
                           cpu=CPUConfig(deferred_experts=deferred)) as hybrid:
        got = hybrid(input_ids=IDS).logits
    assert rel_err(got, want) <= FP32_TOL
    assert rel_err(got, exact) > 100 * FP32_TOL  # the approximation is really taken (so the test can fail)


def test_a_forward_stopped_midway_leaves_nothing_for_the_next(tiny_dir, monkeypatch):
    path = tiny_dir("qwen3_moe")
    with load_hybrid_model(path, None, gpu_device="cpu", dtype=torch.float32, progress=False,
                           cpu=CPUConfig(deferred_experts=1)) as hybrid:
        want = hybrid(input_ids=IDS).logits
        layers = decoder_layers(hybrid.model)
        attention = layers[-1].self_attn  # after earlier MoE layers have deferred their job
        original = attention.forward

        def fail(*args, **kwargs):
            raise RuntimeError("attention failed")

        monkeypatch.setattr(attention, "forward", fail)
        with pytest.raises(RuntimeError, match="attention failed"):
            hybrid(input_ids=IDS[:, :5])
        monkeypatch.setattr(attention, "forward", original)
        assert torch.equal(hybrid(input_ids=IDS).logits, want)


def test_batched_sequences_get_what_they_get_alone(tiny_dir):
    """The split is per token: a sequence's tokens do not depend on which sequences share its steps."""
    path = tiny_dir("qwen3_moe")
    prompts = [[5, 17, 42, 99], [3, 250, 61, 7, 128, 33, 90], [12]]
    params = SamplingParams(max_tokens=4)
    with LLM(path, dtype=torch.float32, max_running=3, progress=False, cpu=CPUConfig(deferred_experts=2)) as llm:
        together = [out.token_ids for out in llm.generate(prompts, params)]
        alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_more_deferred_than_routed_or_with_training_is_one_line(tiny_dir):
    path = tiny_dir("qwen3_moe")
    k = detect(load_config(path)).top_k
    with pytest.raises(TiermoeError, match=f"routes each token to {k} experts, so at most {k} can be deferred"):
        load_hybrid_model(path, None, gpu_device="cpu", progress=False, cpu=CPUConfig(deferred_experts=k + 1))
    with pytest.raises(TiermoeError, match="a model to fine-tune computes every expert in its layer"):
        load_hybrid_model(path, None, gpu_device="cpu", progress=False, trainable=True,
                          cpu=CPUConfig(deferred_experts=1))
    with pytest.raises(TiermoeError, match="must be an integer >= 0"):
        CPUConfig(deferred_experts=-1)
