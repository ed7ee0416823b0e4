"""MLAAttention: DeepSeek V2/V3 attention that caches the latent and attends from it (tiermoe.layers.mla_math).

The loader puts one in place of every DeepseekV2Attention / DeepseekV3Attention (as HybridMoE replaces the MoE
blocks), before the weights are read: it takes over the original's projections and norms under the same names,
so the checkpoint's tensors (FP8-stored ones included) load into it unchanged, and it keeps no copy of any
weight: W_UK and W_UV are views of kv_b_proj's weight, whose rows the loader regroups once, in place, from per
head to [W_UK; W_UV] (group_kv_b_rows) so both views are contiguous.

Per token and layer the cache holds only the normalised compressed KV [.., kv_lora_rank] (as a cache layer's
"keys") and the roped key part [.., qk_rope_head_dim] ("values"): one head, so the engine's KV pool
(tiermoe.layers.paged_attention) stores it as it does any attention layer's K/V. Decode attends with W_UK folded
into the query and W_UV applied after the sum, so the past is read as cached and never expanded; a prefill chunk
long enough for the expansion to be cheaper (mla_math.attend_expanded: and the past short enough for its
expansion to stay small) expands the past for that forward only, and attends with the model's attention
implementation, exactly as transformers does. In the engine's ragged step each part (the decode rows as one
padded batch, each chunk alone) chooses for itself, on the pages the pool gathers for it; where the step's decode
rows attend in place (tiermoe.layers.decode_attention: on the CPU, bf16, where its kernel_attends_mla) they read
the latent and roped key where they lie, as one two-part key per position whose first part is also the value,
and only the chunks' pages are gathered.

Rope stays the model's own function: complex rotation in V2, cos/sin (interleaved or not, `rope_interleave`) in
V3; the softmax scale is the original's (yarn's mscale included).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers.models.deepseek_v2.modeling_deepseek_v2 as deepseek_v2
import transformers.models.deepseek_v3.modeling_deepseek_v3 as deepseek_v3
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tiermoe.experts.kernel_matmuls import KERNEL_DTYPES, packed_heads_product
from tiermoe.layers.mla_math import (
    ROPE_HALF,
    ROPE_INTERLEAVE,
    ROPE_PAIRS,
    absorb_query,
    absorbed_attention,
    attend_expanded,
    group_kv_b_rows,
    latent_attention,
    split_kv_b,
    values_from_latent,
)
from tiermoe.layers.paged_attention import (
    PAGED_PREFIX,
    STEP_KWARG,
    attend_parts,
    part_keys,
    part_queries,
    segment_keys,
)
from tiermoe.layers.quantized_linear import QuantizedLinear

# What the forward needs of the original module besides its submodules.
_ATTRIBUTES = ("config", "layer_idx", "num_heads", "q_lora_rank", "qk_rope_head_dim", "kv_lora_rank", "v_head_dim",
               "qk_nope_head_dim", "qk_head_dim", "num_key_value_groups", "is_causal", "scaling", "attention_dropout")


def _rope_v2(module, q_pe, k_pe, position_embeddings):
    return deepseek_v2.apply_rotary_emb(q_pe, k_pe, position_embeddings.to(q_pe.device))


def _rope_v3(module, q_pe, k_pe, position_embeddings):
    cos, sin = position_embeddings
    if module.config.rope_interleave:
        return deepseek_v3.apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)
    return deepseek_v3.apply_rotary_pos_emb(q_pe, k_pe, cos, sin)


def _rope_form(original: nn.Module) -> int:
    """The native rope's form of this rope (csrc/rotary.cpp tm_mla_rope): V2's complex pairs, V3's halves (after
    its de-interleave where `rope_interleave`)."""
    if isinstance(original, deepseek_v2.DeepseekV2Attention):
        return ROPE_PAIRS
    return ROPE_INTERLEAVE if original.config.rope_interleave else ROPE_HALF


# transformers' MLA attention classes -> (their rope, their eager attention)
_MLA_CLASSES: dict[type, tuple[Callable, Callable]] = {
    deepseek_v2.DeepseekV2Attention: (_rope_v2, deepseek_v2.eager_attention_forward),
    deepseek_v3.DeepseekV3Attention: (_rope_v3, deepseek_v3.eager_attention_forward),
}


class MLAAttention(nn.Module):
    """Replaces a transformers MLA attention module, taking its weights; caches [latent | k_pe] per token."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self._rope, self._eager = _MLA_CLASSES[type(original)]
        for name in _ATTRIBUTES:
            setattr(self, name, getattr(original, name))
        for name, child in original.named_children():  # the same names: the checkpoint's tensors load as they are
            self.add_module(name, child)
        self.kv_b_grouped = False  # kv_b_proj's rows: per head as stored, until group_kv_b_rows
        # the native decode (tiermoe.layers.mla_decode_call, attached where every piece is native): a decode step in
        # one call, and the per-op path's rope through the same native function
        self.native = None
        self.rope_form = _rope_form(original)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask: torch.Tensor | None = None,
                cache=None, past_key_values=None, **kwargs) -> tuple[torch.Tensor, None]:
        cache = cache if cache is not None else past_key_values
        step = kwargs.pop(STEP_KWARG, None)
        if self.native is not None and step is not None:
            out = self.native(self, hidden_states, position_embeddings, cache, step)
            if out is not None:
                return out, None
        B, Q = hidden_states.shape[:-1]
        N, P, R = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_nope, q_pe = q.view(B, Q, -1, self.qk_head_dim).transpose(1, 2).split([N, P], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([R, P], dim=-1)
        latent = self.kv_a_layernorm(latent).view(B, 1, Q, R)
        k_pe = k_pe.view(B, 1, Q, P)
        if self.native is None or not self.native.rope(q_pe, k_pe, position_embeddings):  # (else roped in place)
            q_pe, k_pe = self._rope(self, q_pe, k_pe, position_embeddings)
        if cache is not None:
            latent, k_pe = cache.update(latent, k_pe, self.layer_idx)  # the past and this forward's: [B, 1, L, *]
        if step is None:
            out_BQHV = self._attend(q_nope, q_pe, latent, k_pe, attention_mask, **kwargs)
        else:  # the engine's ragged step over the KV pool: each part (decode batch, segment) on its own keys
            window = step.layer_windows[self.layer_idx]
            out_BQHV = q_nope.new_empty((1, Q, self.num_heads, self.v_head_dim))
            if step.decode_attention is not None:  # latent and k_pe are the layer's slots [S, 1, *]
                latent, k_pe = self._decode_in_place(step, window, q_nope, q_pe, latent, k_pe, out_BQHV[0])
            out_BQHV = attend_parts(step, window, out_BQHV,
                                    lambda part: self._attend(part_queries(q_nope, part), part_queries(q_pe, part),
                                                              part_keys(latent, part), part_keys(k_pe, part),
                                                              part.mask, **kwargs))
        return self.o_proj(out_BQHV.reshape(B, Q, -1)), None

    def _decode_in_place(self, step, window, q_nope_1HQN, q_pe_1HQP, latent_SR, k_pe_SP,
                         out_QHV) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' absorbed attention read from the slots where they lie (latent [S, 1, R] and k_pe
        [S, 1, P]: a two-part key whose first part is also the value; tiermoe.layers.decode_attention) into out's
        first rows; returns the segments' gathered latent and k_pe [1, 1, K, *] (what the parts read)."""
        n, R = step.num_decode, self.kv_lora_rank
        packed = self.packed_kv_b(q_nope_1HQN.dtype)
        if packed is None:
            w_uk, w_uv = self._kv_b_halves(q_nope_1HQN.dtype)
            query_nHX = torch.cat((absorb_query(q_nope_1HQN[:, :, :n], w_uk), q_pe_1HQP[:, :, :n]), dim=-1)[0]
            query_nHX = query_nHX.transpose(0, 1)
        else:  # W_UK's products written into the query's first R values of each head, the roped part after them
            query_nHX = q_nope_1HQN.new_empty((n, self.num_heads, R + self.qk_rope_head_dim))
            self._absorb_packed(packed, q_nope_1HQN[:, :, :n], query_nHX[None, :, :, :R].transpose(1, 2))
            query_nHX[:, :, R:] = q_pe_1HQP[0, :, :n].transpose(0, 1)
        out_latent_nHR = q_nope_1HQN.new_empty((n, self.num_heads, R))
        step.attend_decode_rows(window, query_nHX, latent_SR, latent_SR, self.scaling, None,
                                out_latent_nHR, kr_SHd=k_pe_SP)
        if packed is None:
            out_QHV[:n] = values_from_latent(out_latent_nHR.transpose(0, 1)[None], w_uv)[0].transpose(0, 1)
        else:
            self._values_packed(packed, out_latent_nHR.transpose(0, 1)[None], out_QHV[None, :n])
        return segment_keys(step, window, latent_SR, k_pe_SP)

    def _attend(self, q_nope, q_pe, latent_B1LR, k_pe_B1LP, attention_mask, **kwargs) -> torch.Tensor:
        """[B, Q, H, V] from queries [B, H, Q, *] and the latent [B, 1, L, *]: expanded or absorbed, whichever
        is cheaper for these sizes (mla_math.attend_expanded)."""
        R, N, P = self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim
        if attend_expanded(q_nope.shape[2], latent_B1LR.shape[2], self.num_heads, R, N, P, self.v_head_dim,
                           q_nope.element_size()):
            return self._expanded_attention(q_nope, q_pe, latent_B1LR, k_pe_B1LP, attention_mask, **kwargs)
        packed = self.packed_kv_b(q_nope.dtype)
        if packed is None:
            w_uk, w_uv = self._kv_b_halves(q_nope.dtype)
            out_BHQV = absorbed_attention(q_nope, q_pe, latent_B1LR[:, 0], k_pe_B1LP[:, 0], w_uk, w_uv,
                                          self.scaling, attention_mask)
            return out_BHQV.transpose(1, 2)
        B, H, Q, _ = q_nope.shape
        q_latent = self._absorb_packed(packed, q_nope, q_nope.new_empty((B, Q, H, R)).transpose(1, 2))
        out_latent = latent_attention(q_latent, q_pe, latent_B1LR[:, 0], k_pe_B1LP[:, 0], self.scaling,
                                      attention_mask)
        return self._values_packed(packed, out_latent, q_nope.new_empty((B, Q, H, self.v_head_dim)))

    def _absorb_packed(self, packed: QuantizedLinear, q_nope_BHQN: torch.Tensor,
                       out_BHQR: torch.Tensor) -> torch.Tensor:
        """W_UK folded into the query (mla_math.absorb_query) by the packed kv_b_proj's heads' products, into out
        (any strides, its last dim contiguous)."""
        x_HMN, out_HMR = _heads_rows(q_nope_BHQN), _heads_rows(out_BHQR)
        packed_heads_product(packed.kernels, packed.team(), packed.packed, x_HMN, 0, self.qk_nope_head_dim, out_HMR,
                             transposed=True, amx_min_rows=packed.amx_min_rows)
        return _written(out_BHQR, out_HMR)

    def _values_packed(self, packed: QuantizedLinear, out_latent_BHQR: torch.Tensor,
                       out_BQHV: torch.Tensor) -> torch.Tensor:
        """W_UV applied to the attention-weighted latent (mla_math.values_from_latent) by the packed kv_b_proj's
        heads' products, into out [B, Q, H, V]."""
        out_BHQV = out_BQHV.transpose(1, 2)
        x_HMR, out_HMV = _heads_rows(out_latent_BHQR), _heads_rows(out_BHQV)
        H, V = self.num_heads, self.v_head_dim
        packed_heads_product(packed.kernels, packed.team(), packed.packed, x_HMR, H * self.qk_nope_head_dim, V,
                             out_HMV, amx_min_rows=packed.amx_min_rows)
        _written(out_BHQV, out_HMV)
        return out_BQHV

    def packed_kv_b(self, dtype: torch.dtype) -> QuantizedLinear | None:
        """kv_b_proj where its absorbed products run on the kernels: packed (CPU-only runs) in the grouped row
        order, with the kernels loaded, heads of whole strips, activations of a kernel dtype."""
        proj = self.kv_b_proj
        if (isinstance(proj, QuantizedLinear) and proj.kernels is not None and self.kv_b_grouped
                and dtype in KERNEL_DTYPES and self.qk_nope_head_dim % 16 == 0 and self.v_head_dim % 16 == 0):
            return proj
        return None

    def _expanded_attention(self, q_nope, q_pe, latent_B1LR, k_pe_B1LP, attention_mask, **kwargs) -> torch.Tensor:
        """transformers' own computation: every past position expanded to per-head K/V for this forward only."""
        B, _, L, _ = latent_B1LR.shape
        H, N, V = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        kv = self.kv_b_proj(latent_B1LR[:, 0])  # [B, L, H * (N + V)]
        if self.kv_b_grouped:
            k_nope, value = (x.view(B, L, H, -1).transpose(1, 2) for x in kv.split([H * N, H * V], dim=-1))
        else:
            k_nope, value = kv.view(B, L, H, N + V).transpose(1, 2).split([N, V], dim=-1)
        key = torch.cat((k_nope, k_pe_B1LP.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        name = self.config._attn_implementation.removeprefix(PAGED_PREFIX)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(name, self._eager)
        out_BQHV, _ = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return out_BQHV

    def group_kv_b_rows(self) -> None:
        """The one re-layout, once the weights are in: kv_b_proj's rows grouped [W_UK; W_UV] in place, so both
        halves are contiguous views, and each a block of whole strips once packed (FP8-stored projections keep
        their stored layout)."""
        proj = self.kv_b_proj
        if self.kv_b_grouped or type(proj) is not nn.Linear or proj.bias is not None or proj.weight.is_meta:
            return
        with torch.no_grad():
            group_kv_b_rows(proj.weight, self.num_heads, self.qk_nope_head_dim)
        self.kv_b_grouped = True

    def _kv_b_halves(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, N, R], W_UV [H, V, R]) in `dtype`: views of kv_b_proj's weight, or of its dequantisation
        for this call (FP8Linear does the same on every forward)."""
        proj = self.kv_b_proj
        dequantized = getattr(proj, "dequantized", None)
        weight = dequantized(dtype) if dequantized is not None else proj.weight.to(dtype)
        return split_kv_b(weight, self.num_heads, self.qk_nope_head_dim, self.kv_b_grouped)


def _heads_rows(x_BHQX: torch.Tensor) -> torch.Tensor:
    """[B, H, Q, X] as [H, B * Q, X]: a view where the strides allow (B = 1, or rows of [B, Q, H, X]), else a
    copy (see _written)."""
    B, H, Q, X = x_BHQX.shape
    return x_BHQX.transpose(0, 1).reshape(H, B * Q, X)


def _written(out_BHQX: torch.Tensor, out_HMX: torch.Tensor) -> torch.Tensor:
    """out_BHQX holding what the kernels wrote into out_HMX, its _heads_rows: copied back where that was a copy."""
    if out_HMX.data_ptr() != out_BHQX.data_ptr():
        B, H, Q, X = out_BHQX.shape
        out_BHQX.copy_(out_HMX.view(H, B, Q, X).transpose(0, 1))
    return out_BHQX


def group_kv_b_rows_of(layers: nn.ModuleList) -> None:
    """Once the weights are loaded: every MLAAttention's one re-layout (MLAAttention.group_kv_b_rows)."""
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        if isinstance(attention, MLAAttention):
            attention.group_kv_b_rows()


def replaced_by_mla_attention(cls: type) -> bool:
    """Whether the loader puts an MLAAttention in place of a module of this class (replace_mla_attention)."""
    return cls in _MLA_CLASSES


def replace_mla_attention(layers: nn.ModuleList) -> int:
    """Put an MLAAttention in place of every decoder layer's transformers MLA attention; returns how many."""
    replaced = 0
    for layer in layers:
        original = getattr(layer, "self_attn", None)
        if replaced_by_mla_attention(type(original)):
            layer.self_attn = MLAAttention(original)
            replaced += 1
    return replaced
