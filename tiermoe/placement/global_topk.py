"""KTransformers' mask generator, with its undefined corners defined.

generate_gpu_experts_masks(activation_freq [L, E], num_gpu_experts) -> bool [L, E] on CPU: one global top-k of
the flattened table, `num_gpu_experts` (a total over all layers) clamped to [0, L*E].
Unlike the original: ties are broken deterministically (lower layer, then lower expert id, first), where torch's
topk leaves them undefined; NaN counts as zero, where the original picks NaN first; non-contiguous tables work.
"""

from __future__ import annotations

import torch

from tiermoe.errors import TiermoeError


def clean_counts(freq) -> torch.Tensor:
    """A 2-D real table as float64 on CPU with NaN replaced by 0 (infinities kept)."""
    freq = torch.as_tensor(freq).detach()
    if freq.dim() != 2:
        raise TiermoeError(f"activation statistics must be 2-D [num_layers, num_experts], got shape {list(freq.shape)}")
    if freq.is_complex() or freq.dtype == torch.bool:
        raise TiermoeError(f"activation statistics must be real numbers, got dtype {freq.dtype}")
    freq = freq.to("cpu", torch.float64)
    return torch.where(torch.isnan(freq), torch.zeros_like(freq), freq)


def top_k_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices of the k largest entries, ties to the lower flat index (stable descending sort)."""
    order = torch.sort(scores.reshape(-1), descending=True, stable=True).indices
    return order[:k]


def generate_gpu_experts_masks(activation_freq, num_gpu_experts: int) -> torch.Tensor:
    """Global top-`num_gpu_experts` of `activation_freq` [L, E] as a CPU bool mask [L, E].

    num_gpu_experts is the total over all layers; negative gives none, more than L*E gives all.
    """
    freq = clean_counts(activation_freq)
    num_layers, num_experts = freq.shape
    k = max(0, min(int(num_gpu_experts), num_layers * num_experts))
    mask = torch.zeros(num_layers * num_experts, dtype=torch.bool)
    mask[top_k_positions(freq, k)] = True
    return mask.reshape(num_layers, num_experts)
