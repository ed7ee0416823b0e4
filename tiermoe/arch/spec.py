"""What tiermoe needs to know about one MoE architecture, read from its Hugging Face config.

In transformers 5 every supported MoE block has the same shape: a router module that returns
`(router_logits, top_k_weights [T, K], top_k_index [T, K])`, a fused experts module, and optionally shared experts.
So an `ArchSpec` is data, not code: the names of those parts, the layer pattern, and where the expert weights
live on disk. The HybridMoE block and the loader are generic over it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermoe.errors import TiermoeError

# How the routed output is combined with the shared experts:
#   "none":  no shared experts
#   "plain": out = routed + shared_experts(x)                        (DeepSeek-V2/V3, GLM4-MoE)
#   "gated": out = routed + sigmoid(shared_expert_gate(x)) * shared_expert(x)   (Qwen2-MoE, Qwen3-Next)
SHARED_KINDS = ("none", "plain", "gated")

# The expert feed-forward:
#   "silu_glu":    down(silu(gate(x)) * up(x)), no biases
#   "gpt_oss_glu": clamped gate/up with biases, glu = gate * sigmoid(alpha * gate), down((up + 1) * glu) + b
#   (the native CPU kernels compute these two)
#   "model":       any other: the experts module's own gating (`_apply_gate`) or, for experts without a gate
#                  (`gated` False: up and down only), its own `act_fn`, computed exactly on the torch path
ACTIVATIONS = ("silu_glu", "gpt_oss_glu", "model")

# Who computes a MoE block around its routed experts:
#   "tiermoe": HybridMoE takes the block's place: the model's router, then both tiers, with the shared experts
#              (SHARED_KINDS) computed while the CPU tier works (the families whose block forward tiermoe knows)
#   "model":   the model's own block forward runs as written (its routing, shared experts, scalings); only its
#              experts module is replaced, by one that computes the two tiers (tiermoe.model.hybrid_experts)
BLOCK_FORWARDS = ("tiermoe", "model")

# How the model's block calls its experts module (block_forward "model"; tiermoe.model.hybrid_experts):
#   "interface":    transformers' experts interface, experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])
#   "around":       the experts module's own forward works around that call (Ergo: each route's output through a
#                   learned RMSNorm of its expert before the weighted sum); the module stays, its call goes to the tiers
#   "every_expert": experts(x [E * T, H]), every expert's copy of every token, scaled by its routing weight (0 where
#                   the router did not pick it: Llama-4); the tiers compute the picked rows only
EXPERTS_CALLS = ("interface", "around", "every_expert")


@dataclass(frozen=True)
class ExpertDiskLayout:
    """Where routed expert weights live in a checkpoint.

    Per-expert keys: `{layers_prefix}.{L}.{block}.experts.{E}.{proj}.weight` with proj in `proj_names`
    (gate, up, down). Fused keys: `{layers_prefix}.{L}.mlp.experts.{gate_up_proj,down_proj}` of shape
    `[E, 2I, H]` / `[E, H, I]` (transformers' own layout), or GPT-OSS's transposed, interleaved `[E, H, 2I]` /
    `[E, I, H]` with `*_bias` tensors when `fused_kind == "gpt_oss"`.
    """

    block: str  # "mlp", or "block_sparse_moe" for Mixtral
    proj_names: tuple[str, str, str]  # gate, up, down
    fused_kind: str  # "transformers" | "gpt_oss"
    # transformers' fused layout of this family (read from its experts module): `[E, H, 2I]` / `[E, I, H]` when
    # transposed, gate and up columns alternating when interleaved (GPT-OSS is both, and has its own fused_kind)
    transposed: bool = False
    interleaved: bool = False
    # (on disk, in the model) name substrings of a released checkpoint, read from transformers' conversion mapping
    # (tiermoe.arch.disk_names): `.block_sparse_moe.` for `.mlp.`, `...input_linear.weight` for `...gate_up_proj`
    renames: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ArchSpec:
    """One model's MoE structure. Shapes use E experts, K top-k, H hidden, I expert intermediate size."""

    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    router_kind: str  # human-readable routing rule, e.g. "softmax -> top-k -> renormalise"
    router_attr: str  # attribute of the MoE block holding the router: "gate" or "router"
    shared_kind: str
    shared_intermediate_size: int  # 0 when there are no shared experts
    activation: str
    expert_bias: bool
    returns_router_scores: bool  # the block returns (hidden, router_scores), as GPT-OSS does
    disk: ExpertDiskLayout
    dtype: torch.dtype  # the checkpoint's dtype from config.json
    moe_path: str = "mlp"  # the MoE block's attribute path in a decoder layer ("" = the decoder layer itself)
    block_forward: str = "tiermoe"  # BLOCK_FORWARDS
    gated: bool = True  # experts have a gate projection (gate_up [2I, H]); False: up [I, H] only
    experts_call: str = "interface"  # EXPERTS_CALLS

    def __post_init__(self):
        if self.shared_kind not in SHARED_KINDS:
            raise ValueError(f"shared_kind must be one of {SHARED_KINDS}, got {self.shared_kind!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.block_forward not in BLOCK_FORWARDS:
            raise ValueError(f"block_forward must be one of {BLOCK_FORWARDS}, got {self.block_forward!r}")
        if self.experts_call not in EXPERTS_CALLS:
            raise ValueError(f"experts_call must be one of {EXPERTS_CALLS}, got {self.experts_call!r}")
        if self.block_forward == "tiermoe" and self.experts_call != "interface":
            raise ValueError(f"block_forward 'tiermoe' calls the experts through the interface, not "
                             f"{self.experts_call!r}")
        self._check_config_values()
        if not self.moe_layers:
            raise ValueError("an ArchSpec needs at least one MoE layer")

    def _check_config_values(self) -> None:
        """The sizes come from a config.json (or a GGUF header) someone wrote: refuse what no model can have, before
        it sizes a tensor or indexes one."""
        for name in ("num_layers", "num_experts", "top_k", "hidden_size", "expert_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TiermoeError(f"the model's config gives {name} = {value!r}; expected an integer >= 1")
        if self.top_k > self.num_experts:
            raise TiermoeError(f"the model's config routes each token to {self.top_k} experts "
                               f"(num_experts_per_tok) but a layer has only {self.num_experts}")
        if not all(0 <= layer < self.num_layers for layer in self.moe_layers):
            raise TiermoeError(f"the model's config puts MoE layers at {list(self.moe_layers)}, outside its "
                               f"{self.num_layers} layers")

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def gate_up_rows(self) -> int:
        """Rows of an expert's first matrix: gate and up (2I), or up alone (I) for experts without a gate."""
        return (2 if self.gated else 1) * self.expert_intermediate_size

    @property
    def params_per_expert(self) -> int:
        """gate, up and down matrices (plus their biases, where the experts have them)."""
        h, i = self.hidden_size, self.expert_intermediate_size
        bias = (self.gate_up_rows + h) if self.expert_bias else 0
        return (self.gate_up_rows + i) * h + bias

    def bytes_per_expert(self, dtype: torch.dtype | None = None) -> int:
        itemsize = (dtype or self.dtype).itemsize
        return self.params_per_expert * itemsize

    @property
    def total_routed_experts(self) -> int:
        return self.num_moe_layers * self.num_experts

    def moe_row_mask(self) -> torch.Tensor:
        """`[L]` bool: True for MoE layers."""
        rows = torch.zeros(self.num_layers, dtype=torch.bool)
        rows[list(self.moe_layers)] = True
        return rows
