from tiermoe.layers.hybrid_moe import HybridMoE

__all__ = ["HybridMoE"]
