"""Multi-head latent attention (DeepSeek V2/V3) computed from the cached latent, as pure functions.

MLA caches, per token and layer, one normalised compressed KV vector c (kv_lora_rank R) and one roped key part
k_pe (qk_rope_head_dim P), shared by all heads. kv_b_proj expands c into each head's non-rotary key
(W_UK [H, N, R]) and value (W_UV [H, V, R]). Attention never needs that expansion:

    score(h, q, l) = (q_nope[h, q] . W_UK[h] c[l] + q_pe[h, q] . k_pe[l]) * scaling
                   = ((W_UK[h]^T q_nope[h, q]) . c[l] + q_pe[h, q] . k_pe[l]) * scaling      (W_UK into the query)
    out(h, q)      = W_UV[h] sum_l p(h, q, l) c[l]                                            (W_UV after the sum)

so the heads share one latent key/value (multi-query attention with head dim R + P and value dim R), and a step
reads the past exactly as cached. Expanding instead costs R x H x (N + V) per past position, absorbing costs
(2R - N - V) x H per past position and query: `absorbing_is_cheaper` picks per forward (decode always absorbs;
a long prefill chunk may expand, transiently, as transformers does).

These functions take the latent as tensors [B, L, *] (one row per sequence, L key positions) and a mask in any
of the forms transformers hands attention, so the paged KV pool can call them with what it gathers.
Legend: B rows, H heads, Q query positions, L key positions, R kv_lora_rank, P rope dim, N nope dim, V value dim.
"""

from __future__ import annotations

import torch


def split_kv_b(w_kv_b: torch.Tensor, num_heads: int, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [H * (N + V), R] -> (W_UK [H, N, R], W_UV [H, V, R]): views, no copy."""
    w_HXR = w_kv_b.view(num_heads, -1, w_kv_b.shape[-1])
    return w_HXR[:, :nope_dim], w_HXR[:, nope_dim:]


def absorb_query(q_nope_BHQN: torch.Tensor, w_uk_HNR: torch.Tensor) -> torch.Tensor:
    """W_UK folded into the query: [B, H, Q, N] -> [B, H, Q, R]."""
    return torch.einsum("bhqn,hnr->bhqr", q_nope_BHQN, w_uk_HNR)


def values_from_latent(out_latent_BHQR: torch.Tensor, w_uv_HVR: torch.Tensor) -> torch.Tensor:
    """W_UV applied to the attention-weighted latent: [B, H, Q, R] -> [B, H, Q, V]."""
    return torch.einsum("bhqr,hvr->bhqv", out_latent_BHQR, w_uv_HVR)


def latent_attention(q_latent_BHQR: torch.Tensor, q_pe_BHQP: torch.Tensor, latent_BLR: torch.Tensor,
                     k_pe_BLP: torch.Tensor, scaling: float, mask=None) -> torch.Tensor:
    """Softmax attention of absorbed queries over the cached latent; returns the weighted latent [B, H, Q, R].

    The heads and query positions are folded into one row axis, so each score matmul reads the latent once, in
    place. `mask`: None (causal, the queries being the last Q of the L positions), or [B or 1, 1, Q, L] boolean
    (True = attend) or additive float, as transformers' mask functions build it for sdpa and eager attention.
    Scores are summed in the inputs' dtype and normalised in float32 (as transformers' eager attention does).
    """
    B, H, Q, R = q_latent_BHQR.shape
    L = latent_BLR.shape[1]
    scores = torch.matmul(q_latent_BHQR.reshape(B, H * Q, R), latent_BLR.transpose(1, 2))
    scores = scores + torch.matmul(q_pe_BHQP.reshape(B, H * Q, -1), k_pe_BLP.transpose(1, 2))
    scores_BHQL = scores.view(B, H, Q, L) * scaling
    if mask is None:
        mask = causal_mask(Q, L, scores.device)
    if mask.dtype == torch.bool:
        scores_BHQL = scores_BHQL.masked_fill(~mask, float("-inf"))
    else:
        scores_BHQL = scores_BHQL + mask
    probs = torch.softmax(scores_BHQL, dim=-1, dtype=torch.float32).to(latent_BLR.dtype)
    return torch.matmul(probs.view(B, H * Q, L), latent_BLR).view(B, H, Q, R)


def causal_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """[1, 1, Q, L] bool: query i (the (L - Q + i)-th position) sees keys up to its own position."""
    keys = torch.arange(num_keys, device=device)
    last_key = torch.arange(num_queries, device=device) + (num_keys - num_queries)
    return (keys[None, :] <= last_key[:, None])[None, None]


def absorbed_attention(q_nope_BHQN: torch.Tensor, q_pe_BHQP: torch.Tensor, latent_BLR: torch.Tensor,
                       k_pe_BLP: torch.Tensor, w_kv_b: torch.Tensor, scaling: float, mask=None) -> torch.Tensor:
    """The whole absorbed form: each head's attention output [B, H, Q, V] from queries (non-rotary and roped
    parts, as the model projects them), the cached latent and k_pe, and kv_b_proj's weight [H * (N + V), R]."""
    w_uk_HNR, w_uv_HVR = split_kv_b(w_kv_b, q_nope_BHQN.shape[1], q_nope_BHQN.shape[-1])
    q_latent = absorb_query(q_nope_BHQN, w_uk_HNR)
    return values_from_latent(latent_attention(q_latent, q_pe_BHQP, latent_BLR, k_pe_BLP, scaling, mask), w_uv_HVR)


def absorbing_is_cheaper(num_queries: int, kv_lora_rank: int, nope_dim: int, v_dim: int) -> bool:
    """Whether attending from the latent costs fewer multiply-adds than expanding the past K/V first (per past
    position and head: Q x (2R - N - V) more for absorbing, R x (N + V) for expanding)."""
    return num_queries * (2 * kv_lora_rank - nope_dim - v_dim) <= kv_lora_rank * (nope_dim + v_dim)
