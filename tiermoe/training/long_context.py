"""Long training contexts: the span of tokens the CPU tier computes at a time in training, forward and backward.

The CPU tier's part of each MoE layer holds, during a pass, buffers proportional to its span (per-pair rows [C*K, D],
each expert's recomputed graph on at most C rows), not to the context; what grows with the context is what any
layer keeps for backward (its input) and the gradients it returns (tiermoe.layers.routed_autograd). With
transformers' gradient checkpointing on top, a context is bounded by host memory: `tiermoe fit --train` predicts it.
"""

from __future__ import annotations

from tiermoe.errors import TiermoeError
from tiermoe.model.hybrid_model import HybridModel


def check_expert_chunk(tokens: int) -> int:
    """`tokens` when it is a span set_expert_chunk takes (an int >= 0), else a one-line error."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise TiermoeError(f"the expert chunk is a number of tokens >= 0 (0: all at once), got {tokens!r}")
    return tokens


def set_expert_chunk(hybrid: HybridModel, tokens: int) -> None:
    """Compute every MoE layer's CPU-tier part `tokens` at a time in training (0: the whole context at once;
    default tiermoe.layers.routed_autograd.DEFAULT_CHUNK). Gradients are the same up to fp32 rounding."""
    check_expert_chunk(tokens)
    for block in hybrid.blocks.values():
        block.expert_chunk = tokens
