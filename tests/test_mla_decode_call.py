"""DeepSeek's MLA decode attention in one native call (tiermoe.layers.mla_decode_call) against the per-op path it
replaces, and the native rope both take against transformers' own rope functions.

The call chains the library's entry points with the per-op path's arguments, so decode steps must be bit for bit
the per-op path's, for every rope form (V2's complex pairs, V3's halves with and without its de-interleave), with
and without compressed queries, in bf16 and in the 4-bit formats. tests/test_layers_mla_attention.py checks both
against transformers' model.
"""

from __future__ import annotations

import pytest
import torch
import transformers.models.deepseek_v2.modeling_deepseek_v2 as deepseek_v2
import transformers.models.deepseek_v3.modeling_deepseek_v3 as deepseek_v3
from test_layers_mla_attention import PROMPTS, variant_dir  # noqa: F401 (a fixture)

from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.experts.kernels import load_kernels
from tiermoe.layers.mla_attention import MLAAttention
from tiermoe.layers.mla_decode_call import MLADecodeCall
from tiermoe.layers.mla_math import ROPE_HALF, ROPE_INTERLEAVE, ROPE_PAIRS

needs_kernels = pytest.mark.skipif(load_kernels() is None, reason="the CPU kernels are not built here")


def _decode(path, fmt: str | None) -> tuple[torch.Tensor, list[MLAAttention]]:
    """Logits of 8 sequences' prompts and then 4 decode steps of all 8 together."""
    with LLM(path, dtype=torch.bfloat16, page_size=4, cpu=CPUConfig(non_expert_dtype=fmt), progress=False) as llm:
        engine = llm.engine
        attentions = [m for m in llm.hybrid.model.modules() if isinstance(m, MLAAttention)]
        seqs = [engine.new_sequence() for _ in PROMPTS]
        logits = [engine.feed([seq], [prompt])[0][-1] for seq, prompt in zip(seqs, PROMPTS)]
        for step in range(4):
            logits += [rows[-1] for rows in engine.feed(seqs, [[60 + step]] * len(seqs))]
        return torch.stack(logits).float(), attentions


@needs_kernels
@pytest.mark.parametrize("name,fmt", [("v2", None), ("v2", "int4"), ("v2-yarn-no-q-lora", None), ("v3", "int4"),
                                      ("v3-rotate-half-no-q-lora", None)])
def test_decode_steps_in_one_call_are_bit_for_bit_the_per_op_path(name, fmt, variant_dir, monkeypatch):  # noqa: F811
    path = variant_dir(name)
    taken = []
    call = MLADecodeCall.__call__
    monkeypatch.setattr(MLADecodeCall, "__call__", lambda self, *a: taken.append(call(self, *a)) or taken[-1])
    native, attentions = _decode(path, fmt)
    assert all(a.native is not None for a in attentions) and len(attentions) == 3
    assert sum(out is not None for out in taken) == 4 * 3  # every layer of every decode step; prompts declined
    assert sum(out is None for out in taken) == len(PROMPTS) * 3
    monkeypatch.setattr(MLADecodeCall, "__call__", lambda self, *a: None)  # the per-op path (its rope native too)
    per_op, _ = _decode(path, fmt)
    assert torch.equal(native, per_op)


class _Wrapped(torch.nn.Module):
    """A projection replaced after loading (as an adapter served per request wraps one)."""

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.linear, self.calls = linear, 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


@needs_kernels
def test_a_model_whose_pieces_are_not_all_native_keeps_the_per_op_path(variant_dir):  # noqa: F811
    path = variant_dir("v2")
    with LLM(path, dtype=torch.bfloat16, progress=False) as llm:  # a projection replaced after loading
        attentions = [m for m in llm.hybrid.model.modules() if isinstance(m, MLAAttention)]
        assert all(m.native is not None for m in attentions)
        for m in attentions:
            m.o_proj = _Wrapped(m.o_proj)
        seq = llm.engine.new_sequence()
        llm.engine.feed([seq], [PROMPTS[0]])
        llm.engine.feed([seq], [[60]])
        assert all(m.o_proj.calls == 2 for m in attentions)  # the decode step called it too
    with LLM(path, dtype=torch.bfloat16, cpu=CPUConfig(non_expert_dtype="none"), progress=False) as llm:
        assert not any(m.native for m in llm.hybrid.model.modules() if isinstance(m, MLAAttention))
    with LLM(path, dtype=torch.float32, progress=False) as llm:  # fp32: no packed linears, gathered MLA rows
        assert not any(m.native for m in llm.hybrid.model.modules() if isinstance(m, MLAAttention))


class _Rope:
    """What tm_mla_rope reads of a step: one sequence's Q rows of H heads (inside wider rows, as q's views are)."""

    def __init__(self, form: int, dtype: torch.dtype, H: int = 3, Q: int = 5, P: int = 64):
        g = torch.Generator().manual_seed(form)
        self.form, self.H, self.Q, self.P = form, H, Q, P
        self.rows = torch.randn(1, Q, H, 16 + P, generator=g).to(dtype)  # [nope | rope] per head
        theta = torch.rand(Q, P // 2, generator=g) * 40
        if form == ROPE_PAIRS:
            self.tables = torch.polar(torch.ones_like(theta), theta)[None]  # freqs_cis [1, Q, P / 2]
        else:
            angles = torch.cat((theta, theta), dim=-1)[None]
            self.tables = (angles.cos().to(dtype), angles.sin().to(dtype))

    def pe(self) -> torch.Tensor:
        return self.rows.transpose(1, 2)[..., 16:]  # [1, H, Q, P], strided

    def native(self) -> torch.Tensor:
        kernels = load_kernels()
        x = self.pe()
        if self.form == ROPE_PAIRS:
            cos = sin = torch.view_as_real(self.tables).reshape(-1, self.P).contiguous()
            stride = self.P
        else:
            cos, sin = self.tables
            stride = cos.stride(-2)
        assert kernels.lib.tm_mla_rope(x.data_ptr(), self.Q, self.H, self.P, x.stride(2), x.stride(1), cos.data_ptr(),
                                       sin.data_ptr(), stride, self.form, int(x.dtype == torch.bfloat16)) == 0
        return x.clone()

    def transformers(self) -> torch.Tensor:
        x = self.pe()
        if self.form == ROPE_PAIRS:
            return deepseek_v2.apply_rotary_emb(x, x, self.tables)[0]
        rope = (deepseek_v3.apply_rotary_pos_emb_interleave if self.form == ROPE_INTERLEAVE
                else deepseek_v3.apply_rotary_pos_emb)
        return rope(x, x, *self.tables)[0]


@needs_kernels
@pytest.mark.parametrize("form", [ROPE_HALF, ROPE_INTERLEAVE, ROPE_PAIRS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_native_rope_is_transformers_rope_bit_for_bit(form, dtype):
    rope = _Rope(form, dtype)
    want = rope.transformers()
    got = rope.native()
    assert torch.equal(got, want)
    assert torch.equal(rope.rows[..., :16], _Rope(form, dtype).rows[..., :16])  # the nope parts untouched
