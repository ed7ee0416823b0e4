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
    """Work of one pass, by the unit it scales with. Bytes and flops are per call of that unit.

    A step runs ONE forward over all its sequences (the engine's paged KV pool, tiermoe.engine.kv_pool): the
    non-expert weights are read once per pass, whatever its sequences; each sequence adds its K/V and its tokens'
    flops. The GPU tier's call costs `gpu_call` whenever it computes; with `grouped_gemm` (one grouped GEMM per
    projection, tiermoe.experts.slotted_tier) no op of it scales with the experts it computes, otherwise each
    distinct expert adds `per_expert` (the tiers' expert-by-expert loop)."""

    per_forward: OpCount  # the non-expert forward of one step (attention, norms, LM head, sampling)
    per_layer: OpCount  # one MoE block call, the tiers' own calls aside (router, split, combine)
    per_cpu_call: OpCount  # extra ops of a block whose CPU tier holds experts (submit, copies, sync, add)
    per_expert: OpCount  # one distinct expert in the tiers' expert-by-expert loop
    forward_bytes: int  # non-expert weights read per forward pass
    sequence_flops: float  # LM head flops per sequence per pass (its kept row)
    token_flops: float  # non-expert flops per token (attention projections, router, shared experts)
    attention_flops_per_context: float  # per token and context position (QK^T and PV)
    kv_bytes_per_token: int  # KV cache bytes per context token (all layers)
    bytes_per_expert: int
    flops_per_pair: float  # one token through one expert
    hidden_bytes: int  # one token's hidden state (a row crossing PCIe to and from the CPU tier)
    num_moe_layers: int
    num_experts: int
    gpu_call: OpCount = NO_OPS  # one GPU-tier call that computes, its experts aside
    grouped_gemm: bool = False  # the GPU tier computes with one grouped GEMM per projection (per_expert unused)

    @classmethod
    def experts_only(cls, bytes_per_expert: int, flops_per_pair: float) -> ModelCosts:
        """Only the routed experts' bytes and flops: no ops, no non-expert work (the same for every placement)."""
        return cls(NO_OPS, NO_OPS, NO_OPS, NO_OPS, 0, 0.0, 0.0, 0.0, 0, bytes_per_expert, flops_per_pair, 0, 0, 0)

    @classmethod
    def from_dict(cls, data: dict) -> ModelCosts:
        """Read back `as_dict` (also a record written before one forward per step: its per-sequence names)."""
        renamed = {"per_sequence": "per_forward", "sequence_bytes": "forward_bytes"}
        fields = {renamed.get(k, k): v for k, v in data.items()}
        return cls(**{k: OpCount(**v) if isinstance(v, dict) else v for k, v in fields.items()})

    def as_dict(self) -> dict:
        return asdict(self)
