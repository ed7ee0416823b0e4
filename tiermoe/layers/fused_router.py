"""FusedTopKRouter: transformers' softmax top-k routers with their tail (softmax in fp32, top-k, renormalisation,
cast) as one native call (tiermoe.experts.layer_ops) instead of six torch ops, bit for bit the same result: the
same weights and the same ids in the same order, ties included (the call runs torch's top-k algorithm).

The routers and what they return besides the logits (`router_logits, weights [T, K], ids [T, K]`):
  Qwen2-MoE, Qwen3-MoE, OLMoE, Qwen3-Next: renormalised when `norm_topk_prob`, weights in the logits' dtype
  Mixtral: always renormalised, weights in fp32
The router's linear is torch's F.linear, or, where the run packs its non-expert linears (CPU-only bf16 models,
tiermoe.model.non_expert_quant.pack_routers), the kernels' product with the weight packed in bf16: the same values
(routers are never quantised), summed in another order, as every packed linear's are.
DeepSeek-V2/V3 and GLM-4-MoE's grouped routers: tiermoe.layers.fused_grouped_router. Left as transformers' own:
GPT-OSS's router (top-k of the logits, then softmax over k in bf16).

`fuse_routers` swaps one in for each such router whose weight lives on the CPU, sharing the weight Parameter.
The native call applies to CPU logits in bf16 / fp32 of at most NATIVE_MAX_ROWS rows with no gradient to track,
on a torch CPU capability whose softmax is replicated (LayerOps.exp_lanes); anything else computes the
transformers formula in torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.experts.layer_ops import NATIVE_DTYPES, LayerOps
from tiermoe.layers.lora_stack import LoRAStack
from tiermoe.layers.module_swap import class_key, swap_modules

NATIVE_MAX_ROWS = 64  # as fused_norm: longer inputs are worth torch's threads

_MODELS = "transformers.models"
# (module, class) -> weights always renormalised and left in fp32 (Mixtral) rather than per norm_topk_prob, cast
ROUTER_CLASSES = {
    **{(f"{_MODELS}.{arch}.modeling_{arch}", name): False for arch, name in (
        ("qwen3_moe", "Qwen3MoeTopKRouter"), ("qwen2_moe", "Qwen2MoeTopKRouter"), ("olmoe", "OlmoeTopKRouter"),
        ("qwen3_next", "Qwen3NextTopKRouter"))},
    (f"{_MODELS}.mixtral.modeling_mixtral", "MixtralTopKRouter"): True,
}


def reference_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool,
                           weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformers routers' tail, op for op."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


class FusedTopKRouter(nn.Module):
    """Replaces `router` (one of ROUTER_CLASSES), sharing its weight. `ops` None: the tail in torch (a router
    swapped in only to take an adapter per request, tiermoe.model.served_adapters)."""

    def __init__(self, router: nn.Module, ops: LayerOps | None):
        super().__init__()
        mixtral = ROUTER_CLASSES[class_key(router)]
        self.top_k, self.num_experts, self.hidden_dim = router.top_k, router.num_experts, router.hidden_dim
        self.renormalize = True if mixtral else bool(router.norm_topk_prob)
        self.cast = not mixtral  # the weights in the logits' dtype
        self.weight = router.weight
        self.ops = ops
        self.replaced = type(router).__name__
        self.packed = None  # the weight packed in bf16 (pack_routers: `weight` is then None); CPU rows only
        self.lora: LoRAStack | None = None  # adapters served per request with LoRA on this router (per row)

    def forward(self, hidden_states: torch.Tensor):
        if hidden_states.dim() != 2:  # HybridMoE passes [T, D] already: no reshape op to dispatch
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        if self.packed is not None:
            logits = self.packed(hidden_states)  # (tokens, experts)
        else:
            logits = F.linear(hidden_states, self.weight)
        if self.lora is not None and self.lora.rows.active:
            delta = self.lora.delta(hidden_states)
            logits = logits if delta is None else logits + delta
        weights_dtype = logits.dtype if self.cast else torch.float32
        if (self.ops is not None and self.ops.exp_lanes is not None and logits.device.type == "cpu" and logits.dtype in NATIVE_DTYPES
                and logits.shape[0] <= NATIVE_MAX_ROWS and logits.is_contiguous()
                and not (torch.is_grad_enabled() and logits.requires_grad)):
            weights, ids = self.ops.softmax_topk(logits, self.top_k, self.renormalize, weights_dtype)
        else:
            weights, ids = reference_softmax_topk(logits, self.top_k, self.renormalize, weights_dtype)
        return logits, weights, ids

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, "
                f"replaces={self.replaced}")


def fuse_routers(model: nn.Module, ops: LayerOps) -> int:
    """Swap a FusedTopKRouter in for every module of ROUTER_CLASSES in `model` whose weight is on the CPU; returns
    how many were swapped."""
    return swap_modules(model, lambda m: class_key(m) in ROUTER_CLASSES and m.weight.device.type == "cpu",
                        lambda m: FusedTopKRouter(m, ops))
