"""DeepSeek's MLA attention of a decode step in one native call (csrc/mla_decode.cpp), for CPU-only bf16 runs.

With packed linears, fused norms and the absorbed products on the kernels, an MLAAttention decode step still made
about thirty dispatched torch ops and eight native calls, each a few microseconds of host time: about 0.7 ms a layer
of a DeepSeek-V2-Lite-shaped 4-bit step on a 2-core box, where its products read in 0.3 ms. `MLADecodeCall` is
attached to an MLAAttention whose pieces are all the native ones (`attach_mla_decode`): its q (q_a, norm, q_b, or
q_proj), kv_a and o_proj packed, kv_b_proj packed with whole-strip heads, its two norms FusedRMSNorm of one kind. A
step whose rows are all decode rows attending the pool in place (the step's native DecodeAttention) then takes the
call; the library chains the entry points the per-op path calls, with that path's arguments, so the output is bit
for bit the per-op path's (tests/test_mla_decode_call.py). The per-op path ropes through the same native function
(`MLADecodeCall.rope`, csrc/rotary.cpp tm_mla_rope) once the call is attached, so the two never differ.
Legend: T decode rows, D hidden, H heads, N / P a query head's nope / rope dims, R kv_lora_rank, V value dim.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from tiermoe.experts.kernels import Kernels, TmAttnArgs, TmLinearArgs, TmMlaDecodeArgs
from tiermoe.layers.decode_attention import DecodeAttention
from tiermoe.layers.fused_norm import FusedRMSNorm
from tiermoe.layers.fused_router import NATIVE_MAX_ROWS
from tiermoe.layers.mla_attention import MLAAttention
from tiermoe.layers.mla_math import ROPE_PAIRS
from tiermoe.layers.paged_attention import PagedStepCache
from tiermoe.layers.quantized_linear import QuantizedLinear, bf16_product_args


class MLADecodeCall:
    """The native decode of one MLAAttention (see the module docstring); made by `attach_mla_decode`."""

    def __init__(self, attention: nn.Module, kernels: Kernels, decode: DecodeAttention, rope_form: int):
        self.kernels, self.decode, self.rope_form = kernels, decode, rope_form
        a = attention
        compressed = a.q_lora_rank is not None
        q_first = a.q_a_proj if compressed else a.q_proj
        norm = a.kv_a_layernorm
        self.like = (torch.empty(0, 1, a.kv_lora_rank, dtype=torch.bfloat16),
                     torch.empty(0, 1, a.qk_rope_head_dim, dtype=torch.bfloat16))  # the pool's slots per layer
        self.layer = a.layer_idx
        # the modules the call reads, by name: a step after one was replaced (an adapter served per request wraps
        # a projection) takes the per-op path, which calls the replacement
        self.modules = {name: a._modules[name] for name in _PIECES if name in a._modules}
        self.err = ctypes.create_string_buffer(256)
        self.work = torch.empty(0, dtype=torch.uint8)
        self.args = TmMlaDecodeArgs(
            D=q_first.in_features, H=a.num_heads, N=a.qk_nope_head_dim, P=a.qk_rope_head_dim, R=a.kv_lora_rank,
            V=a.v_head_dim, L=a.q_lora_rank or 0, norm_kind=norm.kind, sum_lanes=norm.ops.sum_lanes,
            rope_form=rope_form, q_eps=a.q_a_layernorm.eps if compressed else 0.0, kv_eps=norm.eps,
            q_a=bf16_product_args(q_first, kernels),
            q_b=bf16_product_args(a.q_b_proj, kernels) if compressed else TmLinearArgs(),
            kv_a=bf16_product_args(a.kv_a_proj_with_mqa, kernels), kv_b=bf16_product_args(a.kv_b_proj, kernels),
            o=bf16_product_args(a.o_proj, kernels),
            q_a_norm=a.q_a_layernorm.weight.data_ptr() if compressed else None,
            kv_a_norm=norm.weight.data_ptr(), attn=TmAttnArgs(isa=kernels.isa, scale=a.scaling))

    def __call__(self, attention: nn.Module, x_1TD: torch.Tensor, position_embeddings, cache,
                 step) -> torch.Tensor | None:
        """`attention`'s o_proj output [1, T, D] of a decode step, or None where the step takes the per-op path."""
        T = x_1TD.shape[1]
        if (any(attention._modules[name] is not module for name, module in self.modules.items())
                or not step.decode_only or step.decode_attention is not self.decode
                or not isinstance(cache, PagedStepCache) or x_1TD.dtype != torch.bfloat16
                or x_1TD.device.type != "cpu" or x_1TD.shape[0] != 1 or T > NATIVE_MAX_ROWS
                or not x_1TD.is_contiguous() or torch.is_grad_enabled()):
            return None
        tables = self._tables(position_embeddings, torch.bfloat16)
        if tables is None:
            return None
        a = self.args
        window = step.layer_windows[self.layer]
        latent_slots, kpe_slots = cache.pages.slots(self.layer, window, *self.like)
        decode = step.groups[window].decode
        team, splits = self.decode.plan(T, a.H, 1, a.R, a.P, a.R, decode.keys, True, 2)
        out = torch.empty_like(x_1TD)
        a.T, a.x, a.out = T, x_1TD.data_ptr(), out.data_ptr()
        a.cos, a.sin, a.cs_row_stride = tables[0].data_ptr(), tables[1].data_ptr(), tables[2]
        a.latent_slots, a.kpe_slots = latent_slots.data_ptr(), kpe_slots.data_ptr()
        a.write_slots = step.groups[window].write_index.data_ptr()
        at = a.attn
        at.page_size, at.max_pages, at.key_splits = step.page_size, decode.tables.shape[1], splits
        at.tables, at.pos, at.lo = decode.tables.data_ptr(), step.decode_pos.data_ptr(), decode.lo.data_ptr()
        a.attend_on_team = int(team is not None)
        nbytes = self.kernels.lib.tm_mla_decode_work_bytes(ctypes.byref(a))
        if self.work.numel() < nbytes:
            self.work = torch.empty(nbytes, dtype=torch.uint8)
        a.work = self.work.data_ptr()
        products = self.decode.team()  # the model's kernel team: the products' (and a shared attention's)
        if self.kernels.lib.tm_mla_decode(products.handle, ctypes.byref(a), self.err, len(self.err)) != 0:
            raise RuntimeError(self.err.value.decode())
        return out

    def _tables(self, position_embeddings, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(cos, sin, row stride) as tm_mla_rope reads them for rows of `dtype`, or None (another layout): V2's
        fp32 (cos, sin) pairs [T, P / 2, 2] (both given as cos), V3's cos / sin [T, P] in `dtype`."""
        if self.rope_form == ROPE_PAIRS:
            if not isinstance(position_embeddings, torch.Tensor) or position_embeddings.dtype != torch.complex64:
                return None
            pairs = torch.view_as_real(position_embeddings).reshape(-1, self.args.P).contiguous()
            return pairs, pairs, self.args.P
        cos, sin = position_embeddings
        if cos.dtype != dtype or cos.stride(-1) != 1 or sin.stride() != cos.stride():
            return None
        return cos, sin, cos.stride(-2)

    def rope(self, q_pe_1HQP: torch.Tensor, k_pe_11QP: torch.Tensor, position_embeddings) -> bool:
        """The per-op path's rope, in place, through the call's native function; False (nothing done) where it does
        not apply: more than one sequence row, or tensors the native function does not take."""
        x = (q_pe_1HQP, k_pe_11QP)
        dtype = q_pe_1HQP.dtype
        if (q_pe_1HQP.shape[0] != 1 or any(t.device.type != "cpu" or t.stride(-1) != 1 for t in x)
                or dtype not in (torch.bfloat16, torch.float32) or k_pe_11QP.dtype != dtype):
            return False
        tables = self._tables(position_embeddings, dtype)
        if tables is None:
            return False
        cos, sin, stride = tables
        for t in x:
            _, H, Q, P = t.shape
            if self.kernels.lib.tm_mla_rope(t.data_ptr(), Q, H, P, t.stride(2), t.stride(1), cos.data_ptr(),
                                            sin.data_ptr(), stride, self.rope_form,
                                            int(dtype == torch.bfloat16)) != 0:
                raise RuntimeError("tm_mla_rope: unknown form or an odd rope dim")
        return True


_PIECES = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
           "o_proj")


def _packed(linear: nn.Module) -> bool:
    return type(linear) is QuantizedLinear and linear.kernels is not None and linear.bias is None


def callable_natively(attention: nn.Module) -> bool:
    """Whether MLADecodeCall computes this MLAAttention's decode (see the module docstring)."""
    compressed = attention.q_lora_rank is not None
    linears = [attention.kv_a_proj_with_mqa, attention.kv_b_proj, attention.o_proj]
    linears += [attention.q_a_proj, attention.q_b_proj] if compressed else [attention.q_proj]
    norms = [attention.kv_a_layernorm] + ([attention.q_a_layernorm] if compressed else [])
    return (all(_packed(p) for p in linears) and attention.packed_kv_b(torch.bfloat16) is not None
            and all(type(n) is FusedRMSNorm and n.weight.dtype == torch.bfloat16 for n in norms)
            and len({n.kind for n in norms}) == 1)


def attach_mla_decode(model: nn.Module, decode: DecodeAttention) -> int:
    """Give every MLAAttention that is `callable_natively` its MLADecodeCall; returns how many."""
    attached = 0
    for module in model.modules():
        if isinstance(module, MLAAttention) and callable_natively(module):
            module.native = MLADecodeCall(module, decode.kernels, decode, module.rope_form)
            attached += 1
    return attached
