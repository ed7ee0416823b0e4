"""What one forward pass of a model costs in work, by the unit it scales with: ops the host dispatches, kernels a
device runs, weight bytes read and flops. tiermoe.analysis.model_op_count counts them on a loaded model;
`ModelCosts.experts_only` keeps just the routed experts' bytes and flops (all that placement changes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class OpCount:
    ops: float  # aten ops the host dispatches
    kernels: float  # of which not views (a GPU launches a kernel for each)

    def __add__(self, other: OpCount) -> OpCount:
        return OpCount(self.ops + other.ops, self.kernels + other.kernels)

    def scaled(self, factor: float) -> OpCount:
        return OpCount(self.ops * factor, self.kernels * factor)


NO_OPS = OpCount(0.0, 0.0)


@dataclass(frozen=True)
class ModelCosts:
    """Work of one pass, by the unit it scales with. Bytes and flops are per call of that unit."""

    per_sequence: OpCount  # non-expert forward of one sequence (attention, norms, LM head, sampling)
    per_layer: OpCount  # one MoE block call, routed experts aside (router, split, combine, empty tier calls)
    per_cpu_call: OpCount  # extra ops of a block whose CPU tier holds experts (submit, copies, sync, add)
    per_expert: OpCount  # one distinct expert computed by the GPU tier
    sequence_bytes: int  # non-expert weights read per sequence per pass
    sequence_flops: float  # LM head flops per sequence per pass
    token_flops: float  # non-expert flops per token (attention projections, router, shared experts)
    attention_flops_per_context: float  # per token and context position (QK^T and PV)
    kv_bytes_per_token: int  # KV cache bytes per context token (all layers)
    bytes_per_expert: int
    flops_per_pair: float  # one token through one expert
    hidden_bytes: int  # one token's hidden state (a row crossing PCIe to and from the CPU tier)
    num_moe_layers: int
    num_experts: int

    @classmethod
    def experts_only(cls, bytes_per_expert: int, flops_per_pair: float) -> ModelCosts:
        """Only the routed experts' bytes and flops: no ops, no non-expert work (the same for every placement)."""
        return cls(NO_OPS, NO_OPS, NO_OPS, NO_OPS, 0, 0.0, 0.0, 0.0, 0, bytes_per_expert, flops_per_pair, 0, 0, 0)

    def as_dict(self) -> dict:
        return asdict(self)
