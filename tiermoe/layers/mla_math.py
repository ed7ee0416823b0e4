"""Multi-head latent attention (DeepSeek V2/V3) computed from the cached latent, as pure functions.

MLA caches, per token and layer, one normalised compressed KV vector c (kv_lora_rank R) and one roped key part
k_pe (qk_rope_head_dim P), shared by all heads. kv_b_proj expands c into each head's non-rotary key
(W_UK [H, N, R]) and value (W_UV [H, V, R]). Attention never needs that expansion:

    score(h, q, l) = (q_nope[h, q] . W_UK[h] c[l] + q_pe[h, q] . k_pe[l]) * scaling
                   = ((W_UK[h]^T q_nope[h, q]) . c[l] + q_pe[h, q] . k_pe[l]) * scaling      (W_UK into the query)
    out(h, q)      = W_UV[h] sum_l p(h, q, l) c[l]                                            (W_UV after the sum)

so the heads share one latent key/value (multi-query attention with head dim R + P and value dim R), and a step
reads the past exactly as cached. Expanding instead costs R x H x (N + V) per past position, absorbing costs
(2R - N - V) x H per past position and query: `attend_expanded` picks per forward (decode always absorbs; a
long prefill chunk expands, for that forward only, as transformers does, while the expansion stays within
MAX_EXPANSION_BYTES; past that it attends absorbed, in query blocks whose scores stay within MAX_SCORE_BYTES).

These functions take the latent as tensors [B, L, *] (one row per sequence, L key positions) and a mask in any
of the forms transformers hands attention, so the paged KV pool can call them with what it gathers.
Legend: B rows, H heads, Q query positions, L key positions, R kv_lora_rank, P rope dim, N nope dim, V value dim.
"""

from __future__ import annotations

import torch

# Transient memory one attention forward may take beyond its inputs: the float32 scores of a block of queries
# (absorbed), and the expanded K/V of the whole past (expanded; beyond it a chunk attends absorbed, in blocks).
MAX_SCORE_BYTES = 256 << 20
MAX_EXPANSION_BYTES = 512 << 20
# The forms of MLA's rope on the roped parts (csrc/rotary.cpp tm_mla_rope, csrc/tm_api.h TmMlaRope): V3's rotate-half,
# V3's after its de-interleave (`rope_interleave`), V2's complex pairs.
ROPE_HALF, ROPE_INTERLEAVE, ROPE_PAIRS = 0, 1, 2


def split_kv_b(w_kv_b: torch.Tensor, num_heads: int, nope_dim: int,
               grouped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [H * (N + V), R] -> (W_UK [H, N, R], W_UV [H, V, R]): views, no copy. Its rows are per
    head, [W_UK[h]; W_UV[h]] (as checkpoints store them: strided views), or `grouped`, [W_UK; W_UV] (contiguous
    views: CPU kernels of 16-bit types copy a strided batch of matrices on every call)."""
    R = w_kv_b.shape[-1]
    if grouped:
        w_uk, w_uv = w_kv_b.split([num_heads * nope_dim, w_kv_b.shape[0] - num_heads * nope_dim])
        return w_uk.view(num_heads, nope_dim, R), w_uv.view(num_heads, -1, R)
    w_HXR = w_kv_b.view(num_heads, -1, R)
    return w_HXR[:, :nope_dim], w_HXR[:, nope_dim:]


def group_kv_b_rows(w_kv_b: torch.Tensor, num_heads: int, nope_dim: int) -> None:
    """Reorder kv_b_proj's weight rows in place from per head to grouped (see split_kv_b): one transient copy."""
    w_uk, w_uv = split_kv_b(w_kv_b, num_heads, nope_dim)
    w_kv_b.copy_(torch.cat((w_uk.reshape(-1, w_kv_b.shape[-1]), w_uv.reshape(-1, w_kv_b.shape[-1]))))


def absorb_query(q_nope_BHQN: torch.Tensor, w_uk_HNR: torch.Tensor) -> torch.Tensor:
    """W_UK folded into the query: [B, H, Q, N] -> [B, H, Q, R] (one batched matmul over the heads)."""
    B, H, Q, N = q_nope_BHQN.shape
    q_HMN = q_nope_BHQN.transpose(0, 1).reshape(H, B * Q, N)
    return torch.bmm(q_HMN, w_uk_HNR).view(H, B, Q, -1).transpose(0, 1)


def values_from_latent(out_latent_BHQR: torch.Tensor, w_uv_HVR: torch.Tensor) -> torch.Tensor:
    """W_UV applied to the attention-weighted latent: [B, H, Q, R] -> [B, H, Q, V]."""
    B, H, Q, R = out_latent_BHQR.shape
    o_HMR = out_latent_BHQR.transpose(0, 1).reshape(H, B * Q, R)
    return torch.bmm(o_HMR, w_uv_HVR.transpose(1, 2)).view(H, B, Q, -1).transpose(0, 1)


def latent_attention(q_latent_BHQR: torch.Tensor, q_pe_BHQP: torch.Tensor, latent_BLR: torch.Tensor,
                     k_pe_BLP: torch.Tensor, scaling: float, mask=None,
                     max_score_bytes: int | None = None) -> torch.Tensor:
    """Softmax attention of absorbed queries over the cached latent; returns the weighted latent [B, H, Q, R].

    The heads and query positions are folded into one row axis, so each score matmul reads the latent once, in
    place. `mask`: None (causal, the queries being the last Q of the L positions), or [B or 1, 1, Q, L] boolean
    (True = attend) or additive float, as transformers' mask functions build it for sdpa and eager attention.
    Scores are summed in the inputs' dtype and normalised in float32 (as transformers' eager attention does);
    query positions go in blocks whose float32 scores stay within `max_score_bytes` (a long past times many
    heads would otherwise take gigabytes; default MAX_SCORE_BYTES).
    """
    B, H, Q, R = q_latent_BHQR.shape
    L = latent_BLR.shape[1]
    if mask is None and Q > 1:
        mask = causal_mask(Q, L, latent_BLR.device)  # (one query sees every key: no mask)
    block = max(1, (max_score_bytes or MAX_SCORE_BYTES) // (B * H * L * 4))
    if block >= Q:
        return _latent_attention_block(q_latent_BHQR, q_pe_BHQP, latent_BLR, k_pe_BLP, scaling, mask)
    out = q_latent_BHQR.new_empty(B, H, Q, R)
    for start in range(0, Q, block):
        rows = slice(start, start + block)
        block_mask = mask[:, :, rows] if mask is not None and mask.shape[2] > 1 else mask
        out[:, :, rows] = _latent_attention_block(q_latent_BHQR[:, :, rows], q_pe_BHQP[:, :, rows], latent_BLR,
                                                  k_pe_BLP, scaling, block_mask)
    return out


def _latent_attention_block(q_latent_BHQR, q_pe_BHQP, latent_BLR, k_pe_BLP, scaling, mask) -> torch.Tensor:
    B, H, Q, R = q_latent_BHQR.shape
    L = latent_BLR.shape[1]
    rope_scores = torch.bmm(q_pe_BHQP.reshape(B, H * Q, -1), k_pe_BLP.transpose(1, 2))
    scores = torch.baddbmm(rope_scores, q_latent_BHQR.reshape(B, H * Q, R), latent_BLR.transpose(1, 2),
                           beta=scaling, alpha=scaling)
    scores_BHQL = scores.view(B, H, Q, L)
    if mask is not None and mask.dtype == torch.bool:
        scores_BHQL.masked_fill_(~mask, float("-inf"))
    elif mask is not None:
        scores_BHQL.add_(mask)
    probs = torch.softmax(scores_BHQL, dim=-1, dtype=torch.float32).to(latent_BLR.dtype)
    return torch.bmm(probs.view(B, H * Q, L), latent_BLR).view(B, H, Q, R)


def causal_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """[1, 1, Q, L] bool: query i (the (L - Q + i)-th position) sees keys up to its own position."""
    keys = torch.arange(num_keys, device=device)
    last_key = torch.arange(num_queries, device=device) + (num_keys - num_queries)
    return (keys[None, :] <= last_key[:, None])[None, None]


def absorbed_attention(q_nope_BHQN: torch.Tensor, q_pe_BHQP: torch.Tensor, latent_BLR: torch.Tensor,
                       k_pe_BLP: torch.Tensor, w_uk_HNR: torch.Tensor, w_uv_HVR: torch.Tensor, scaling: float,
                       mask=None, max_score_bytes: int | None = None) -> torch.Tensor:
    """The whole absorbed form: each head's attention output [B, H, Q, V] from queries (non-rotary and roped
    parts, as the model projects them), the cached latent and k_pe, and kv_b_proj's two halves (split_kv_b)."""
    q_latent = absorb_query(q_nope_BHQN, w_uk_HNR)
    out_latent = latent_attention(q_latent, q_pe_BHQP, latent_BLR, k_pe_BLP, scaling, mask, max_score_bytes)
    return values_from_latent(out_latent, w_uv_HVR)


def absorbing_is_cheaper(num_queries: int, kv_lora_rank: int, nope_dim: int, v_dim: int) -> bool:
    """Whether attending from the latent costs fewer multiply-adds than expanding the past K/V first (per past
    position and head: Q x (2R - N - V) more for absorbing, R x (N + V) for expanding)."""
    return num_queries * (2 * kv_lora_rank - nope_dim - v_dim) <= kv_lora_rank * (nope_dim + v_dim)


def expansion_bytes(num_keys: int, num_heads: int, nope_dim: int, rope_dim: int, v_dim: int, itemsize: int) -> int:
    """Bytes a forward's expanded K/V of `num_keys` positions takes: kv_b_proj's output, and the keys it
    concatenates with the roped part."""
    return num_keys * num_heads * (nope_dim + v_dim + nope_dim + rope_dim) * itemsize


def attend_expanded(num_queries: int, num_keys: int, num_heads: int, kv_lora_rank: int, nope_dim: int,
                    rope_dim: int, v_dim: int, itemsize: int, max_bytes: int | None = None) -> bool:
    """Whether a forward of `num_queries` over `num_keys` positions expands the past (cheaper, and its transient
    K/V within `max_bytes`, default MAX_EXPANSION_BYTES) rather than attending from the latent. Decode never
    expands."""
    return (not absorbing_is_cheaper(num_queries, kv_lora_rank, nope_dim, v_dim)
            and expansion_bytes(num_keys, num_heads, nope_dim, rope_dim, v_dim, itemsize)
            <= (max_bytes or MAX_EXPANSION_BYTES))
