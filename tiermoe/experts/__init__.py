"""Routed expert weights, their feed-forward, and the two tiers that hold and compute them."""

from tiermoe.experts.ffn import ExpertActivation, routed_experts_forward
from tiermoe.experts.native import NativeCPUExperts
from tiermoe.experts.tiers import (
    CPUExpertBackend,
    CPUWorker,
    ExpertSet,
    TorchCPUExperts,
)
from tiermoe.experts.weights import ExpertWeights

__all__ = [
    "CPUExpertBackend",
    "CPUWorker",
    "ExpertActivation",
    "ExpertSet",
    "ExpertWeights",
    "NativeCPUExperts",
    "TorchCPUExperts",
    "routed_experts_forward",
]
