"""A bandwidth cost model: what a routed (token, expert) pair costs on each tier, and what a copy costs.

Decode is memory-bound: an expert's weights are read once per forward pass that routes to it, from host
memory on the CPU tier and from GPU memory on the GPU tier; a swap moves an expert across PCIe. This is the
simple model dynamic placement decides with until measured profiles (the placement benchmark) replace it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BandwidthCostModel:
    bytes_per_expert: int
    cpu_read_bandwidth: float = 25e9  # bytes/s: this 2-core box measures 23-25 GB/s
    gpu_read_bandwidth: float = 1.0e12  # bytes/s: RTX 4090 ~1 TB/s, H200 ~4.8 TB/s
    copy_bandwidth: float = 25e9  # bytes/s over PCIe 4.0 x16 (pinned)
    flops_per_pair: float = 0.0  # 2 x 3 x H x I: one token through one expert
    cpu_flops: float = 4e11  # FLOP/s the CPU backend sustains on large batches
    gpu_flops: float = 1e14

    def cpu_expert_seconds(self) -> float:
        """One CPU-tier expert read (one pass that routes to it)."""
        return self.bytes_per_expert / self.cpu_read_bandwidth

    def gpu_expert_seconds(self) -> float:
        return self.bytes_per_expert / self.gpu_read_bandwidth

    def copy_seconds(self, experts: int = 1) -> float:
        return experts * self.bytes_per_expert / self.copy_bandwidth

    def cpu_pass_seconds(self, distinct_experts: int, pairs: int) -> float:
        """CPU-tier time of one pass: each distinct expert read once, or the math, whichever is slower."""
        return max(distinct_experts * self.cpu_expert_seconds(), pairs * self.flops_per_pair / self.cpu_flops)

    def gpu_pass_seconds(self, distinct_experts: int, pairs: int) -> float:
        return max(distinct_experts * self.gpu_expert_seconds(), pairs * self.flops_per_pair / self.gpu_flops)

    def saving_per_activation(self) -> float:
        """Seconds saved each time a pass routes to an expert that is on the GPU tier instead of the CPU tier."""
        return self.cpu_expert_seconds() - self.gpu_expert_seconds()
