"""Decode steps through DecodeFusedAttention (one qkv projection, native rotary, the pool read in place) give
what transformers' attention gives: fp32 logits of every decode step within 1e-5 of the unmodified model's
(FP32_TOL of test_engine_kv_pool: sums in another order), for each fused family, alone and batched, and for
families whose attention has the code of one of them under another name (tiermoe.arch.code_form)."""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference, make_mask, rel_err
from transformers import AutoModelForCausalLM

from tiermoe.arch import detect, load_config
from tiermoe.engine.llm import LLM
from tiermoe.experts.kernels import load_kernels
from tiermoe.layers.fused_attention import DecodeFusedAttention
from tiermoe.testing.presets import TINY, make_config
from tiermoe.testing.zoo_exactness import write_tiny

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="the CPU kernels are not built here")
FP32_TOL = 2e-5


@pytest.mark.exactness
# Mellum's attention is Qwen3-MoE's code; PhiMoE's (q/k/v biases) and Granite-MoE's (its own scaling) Qwen2-MoE's;
# GLM-4.5's partial rotary, with and without its q/k norms and q/k/v biases; Qwen3-Next's gated output (its full
# attention layers, between linear-attention ones)
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "mellum", "phimoe", "granitemoe",
                                  "glm4_moe", "glm4_moe+qk_norm", "qwen3_next"])
def test_decode_steps_of_fused_attention_equal_transformers(arch, tiny_dir, tmp_path, monkeypatch):
    if arch == "glm4_moe+qk_norm":
        path = tmp_path / arch
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(make_config("glm4_moe", use_qk_norm=True, attention_bias=True,
                                                     initializer_range=0.1)).save_pretrained(path)
    elif arch in TINY:
        path = tiny_dir(arch)
    else:
        path = tmp_path / arch
        write_tiny(arch, path)
    ref = load_reference(path)
    prompts = [[3 + (5 * i + 7 * s) % 200 for i in range(n)] for s, n in enumerate([4, 9, 13])]
    mask = make_mask("random_half", detect(load_config(path)))
    decoded = []  # the fused decodes of each step
    fused_decode = DecodeFusedAttention._decode
    monkeypatch.setattr(DecodeFusedAttention, "_decode", lambda self, *a: decoded.append(1) or fused_decode(self, *a))
    with LLM(path, placement=mask, dtype=torch.float32, page_size=4, progress=False) as llm:
        layers = [layer for layer in llm.hybrid.model.model.layers if hasattr(layer, "self_attn")]
        assert layers and all(isinstance(layer.self_attn, DecodeFusedAttention) for layer in layers)
        engine = llm.engine
        seqs = [engine.new_sequence() for _ in prompts]
        tokens = [list(p) for p in prompts]
        for seq, prompt in zip(seqs, prompts):  # prompts one at a time: the decode steps below are pure
            row = engine.feed([seq], [prompt])[0]
            tokens[seqs.index(seq)].append(int(row[-1].argmax()))
        fused_steps = 0
        for _ in range(3):
            decoded.clear()
            rows = engine.feed(seqs, [[t[-1]] for t in tokens])
            fused_steps += len(decoded) == len(layers)  # every attention layer's step fused
            for t, row in zip(tokens, rows):
                t.append(int(row[-1].argmax()))
            for i, row in enumerate(rows):
                with torch.no_grad():
                    want = ref(torch.tensor([tokens[i][:-1]])).logits[0, -1]
                assert rel_err(row[-1], want) <= FP32_TOL, (arch, i)
        assert fused_steps == 3
        for seq in seqs:
            engine.release(seq)
