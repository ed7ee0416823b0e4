"""The 9 tuned families keep their speed with specs discovered from transformers' modules (tiermoe.arch.discover):
one decode step dispatches per decoder layer the torch ops it dispatched with the hand-written specs before (the
pinned counts were measured with those specs and are unchanged), and the layer classes that take the fused
native decode paths (a whole layer in one native call; fused attention) are named here."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, save_tiny

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.layer_ops import load_layer_ops
from tiermoe.layers.fused_attention import DecodeFusedAttention
from tiermoe.layers.fused_decode_layer import FusedDecodeLayer
from tiermoe.testing.op_counter import OpCounter

# Mixtral's and GPT-OSS's tiny intermediate size (48) is no bf16 kernel shape (multiples of 32): their CPU tier would
# compute in torch and their fused layer fall back per op, so they are measured at 64.
SIZES = {"mixtral": {"intermediate_size": 64}, "gpt_oss": {"intermediate_size": 64}}
# Per decoder layer, ops of one decode step (a 4-token prompt, then one token), fp32 and bf16: the per-op path, and
# in bf16 the fused native paths (2 ops: Qwen3-MoE's, Mixtral's and GPT-OSS's whole layer in one call; qwen3_moe's
# layer 1 is dense). Measured with the hand-written specs and again with the discovered ones: the same numbers. The
# families with shared experts count 3 more in bf16 per MoE layer since their CPU tier computes on the engine's thread
# (HybridMoE.shared_on_team): its own ops, which ran on the worker thread before, where the counter does not look.
# DeepSeek's MLA attention decodes in one native call in bf16 (tiermoe.layers.mla_decode_call): 108 / 113 ops a layer
# before it, 28 / 26 now (V2 / V3, dense layer), the rest being the layer's norms, residuals and MoE block.
# GLM-4.5's attention decodes through DecodeFusedAttention (partial rotary): 52 / 87 ops a dense layer before, 22 / 47;
# Qwen3-Next's (gated output) its full-attention layer 4: 69 / 112 before, 39 / 72.
OPS_PER_LAYER = {
    "qwen3_moe": ([56, 24, 56], [2, 49, 2]),
    "qwen2_moe": ([32, 32], [67, 67]),
    "qwen3_next": ([69, 69, 69, 39], [107, 107, 107, 72]),
    "mixtral": ([54, 54], [2, 2]),
    "deepseek_v2": ([102, 112, 112], [28, 41, 41]),
    "deepseek_v3": ([107, 117, 117], [26, 39, 39]),
    "glm4_moe": ([22, 32, 32], [47, 60, 60]),
    "olmoe": ([80, 80], [113, 113]),
    "gpt_oss": ([66, 66], [2, 2]),
}
# What takes the fused native decode paths in bf16 on a CPU main device: the decoder layers that become a
# FusedDecodeLayer, and the attention classes that become a DecodeFusedAttention.
WHOLE_LAYER = {"qwen3_moe": "Qwen3MoeDecoderLayer", "mixtral": "MixtralDecoderLayer", "gpt_oss": "GptOssDecoderLayer"}
FUSED_ATTENTION = {"qwen3_moe": "Qwen3MoeAttention", "mixtral": "MixtralAttention", "qwen2_moe": "Qwen2MoeAttention",
                   "gpt_oss": "GptOssAttention", "glm4_moe": "Glm4MoeAttention", "qwen3_next": "Qwen3NextAttention"}

needs_ops = pytest.mark.skipif(load_layer_ops() is None, reason="the kernel library is unavailable")


def decode_step(path, dtype: torch.dtype) -> tuple[list[int], set[str], set[str]]:
    """(ops per decoder layer of one decode step, the decoder layer classes that run as a FusedDecodeLayer, the
    attention classes that run as a DecodeFusedAttention)."""
    llm = LLM(path, dtype=dtype, progress=False)
    counter, inside, per_layer = OpCounter(), [], []
    try:
        layers = llm.hybrid.model.model.layers
        for layer in layers:
            layer.register_forward_pre_hook(lambda *_: inside.append(counter.ops))
            layer.register_forward_hook(lambda *_: per_layer.append(counter.ops - inside.pop()))
        llm.engine.add([3, 4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
        llm.engine.step()  # prefill
        per_layer.clear()
        with counter:
            llm.engine.step()
        whole = {m.original_class.__name__ for m in layers if isinstance(m, FusedDecodeLayer)}
        attention = {m.original_class.__name__ for m in llm.hybrid.model.modules()
                     if isinstance(m, DecodeFusedAttention)}
        return per_layer, whole, attention
    finally:
        llm.close()


@needs_ops
@pytest.mark.parametrize("arch", ARCHS)
def test_a_tuned_family_decodes_with_the_op_counts_and_fused_paths_of_its_hand_written_spec(arch, tmp_path):
    torch.manual_seed(0)
    path = save_tiny(arch, tmp_path, sizes=SIZES.get(arch))
    fp32_ops, _, _ = decode_step(path, torch.float32)
    bf16_ops, whole, attention = decode_step(path, torch.bfloat16)
    assert (fp32_ops, bf16_ops) == OPS_PER_LAYER[arch], "a change of ops per layer is a change of decode speed"
    assert whole == ({WHOLE_LAYER[arch]} if arch in WHOLE_LAYER else set())
    assert attention == ({FUSED_ATTENTION[arch]} if arch in FUSED_ATTENTION else set())
