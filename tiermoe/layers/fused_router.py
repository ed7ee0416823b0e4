"""FusedTopKRouter: transformers' softmax top-k routers with their tail (softmax in fp32, top-k, renormalisation,
cast) as one native call (tiermoe.experts.layer_ops) instead of six torch ops, bit for bit the same result: the
same weights and the same ids in the same order, ties included (the call runs torch's top-k algorithm).

The routers and what they return besides the logits (`router_logits, weights [T, K], ids [T, K]`):
  Qwen2-MoE, Qwen3-MoE, OLMoE, Qwen3-Next: renormalised when `norm_topk_prob`, weights in the logits' dtype
  Mixtral: always renormalised, weights in fp32
  Qwen3.5-MoE: always renormalised, weights in the logits' dtype
  GPT-OSS: a linear with a bias, then the top-k of the logits and the softmax over those k, in the logits' dtype
The router's linear is torch's F.linear, or, where the run packs its non-expert linears (CPU-only bf16 models,
tiermoe.model.non_expert_quant.pack_routers), the kernels' product with the weight packed in bf16 (with a bias, the
product in fp32 and the bias added before the one rounding, as F.linear rounds): the same values (routers are never
quantised), summed in another order, as every packed linear's are.
DeepSeek-V2/V3 and GLM-4-MoE's grouped routers: tiermoe.layers.fused_grouped_router.

`fuse_routers` swaps one in for each such router whose weight lives on the CPU, sharing the weight Parameter.
The native call applies to CPU logits in bf16 / fp32 of at most NATIVE_MAX_ROWS rows with no gradient to track,
on a torch CPU capability whose softmax is replicated (LayerOps.exp_lanes); anything else computes the
transformers formula in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.arch.code_form import CodeForms
from tiermoe.experts.layer_ops import NATIVE_DTYPES, LayerOps
from tiermoe.layers.lora_stack import LoRAStack
from tiermoe.layers.module_swap import swap_modules

NATIVE_MAX_ROWS = 64  # as fused_norm: longer inputs are worth torch's threads

_MODELS = "transformers.models"


@dataclass(frozen=True)
class RouterTail:
    """What a router class does after its linear (see the module docstring)."""

    always_renormalize: bool = False  # else per the router's norm_topk_prob
    weights_in_logits_dtype: bool = True  # else fp32
    topk_first: bool = False  # the top-k of the logits, then the softmax over k (renormalisation unused)


# (module, class) -> its tail; a class with the same code as one of these is taken too (tiermoe.arch.code_form)
ROUTER_FORMS = CodeForms({
    **{(f"{_MODELS}.{arch}.modeling_{arch}", name): RouterTail() for arch, name in (
        ("qwen3_moe", "Qwen3MoeTopKRouter"), ("qwen2_moe", "Qwen2MoeTopKRouter"), ("olmoe", "OlmoeTopKRouter"),
        ("qwen3_next", "Qwen3NextTopKRouter"))},
    (f"{_MODELS}.mixtral.modeling_mixtral", "MixtralTopKRouter"): RouterTail(True, weights_in_logits_dtype=False),
    (f"{_MODELS}.gpt_oss.modeling_gpt_oss", "GptOssTopKRouter"): RouterTail(topk_first=True),
    (f"{_MODELS}.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeTopKRouter"): RouterTail(always_renormalize=True),
})


def reference_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, weights_dtype: torch.dtype,
                           topk_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformers routers' tail, op for op."""
    if topk_first:
        values, ids = torch.topk(logits, k, dim=-1)
        return F.softmax(values, dim=1, dtype=values.dtype).to(weights_dtype), ids
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


class FusedTopKRouter(nn.Module):
    """Replaces `router` (of one of ROUTER_FORMS), sharing its weight. `ops` None: the tail in torch (a router
    swapped in only to take an adapter per request, tiermoe.model.served_adapters)."""

    def __init__(self, router: nn.Module, ops: LayerOps | None):
        super().__init__()
        tail = ROUTER_FORMS.of(type(router))
        self.top_k, self.num_experts, self.hidden_dim = router.top_k, router.num_experts, router.hidden_dim
        self.topk_first = tail.topk_first
        self.renormalize = not tail.topk_first and (tail.always_renormalize or bool(router.norm_topk_prob))
        self.cast = tail.weights_in_logits_dtype
        self.weight = router.weight
        self.bias = getattr(router, "bias", None)  # GPT-OSS's (shared, as the weight is)
        self.ops = ops
        self.replaced = type(router).__name__
        self.packed = None  # the weight packed in bf16 (pack_routers: `weight` is then None); CPU rows only
        self.lora: LoRAStack | None = None  # adapters served per request with LoRA on this router (per row)

    def forward(self, hidden_states: torch.Tensor):
        if hidden_states.dim() != 2:  # HybridMoE passes [T, D] already: no reshape op to dispatch
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        if self.packed is not None and self.bias is not None:
            # rounded once, after the bias, as F.linear with a bias rounds: the product's fp32 sums, then the bias
            logits = (self.packed(hidden_states.float()) + self.bias.float()).to(hidden_states.dtype)
        elif self.packed is not None:
            logits = self.packed(hidden_states)  # (tokens, experts)
        else:
            logits = F.linear(hidden_states, self.weight, self.bias)
        if self.lora is not None and self.lora.rows.active:
            delta = self.lora.delta(hidden_states)
            logits = logits if delta is None else logits + delta
        weights_dtype = logits.dtype if self.cast else torch.float32
        if (self.ops is not None and self.ops.exp_lanes is not None and logits.device.type == "cpu" and logits.dtype in NATIVE_DTYPES
                and logits.shape[0] <= NATIVE_MAX_ROWS and logits.is_contiguous()
                and not (torch.is_grad_enabled() and logits.requires_grad)):
            weights, ids = self.ops.softmax_topk(logits, self.top_k, self.renormalize, weights_dtype, self.topk_first)
        else:
            weights, ids = reference_softmax_topk(logits, self.top_k, self.renormalize, weights_dtype,
                                                  self.topk_first)
        return logits, weights, ids

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, "
                f"topk_first={self.topk_first}, replaces={self.replaced}")


def fuse_routers(model: nn.Module, ops: LayerOps) -> int:
    """Swap a FusedTopKRouter in for every module of ROUTER_FORMS in `model` whose weight is on the CPU; returns
    how many were swapped."""
    return swap_modules(model, lambda m: ROUTER_FORMS.of(type(m)) is not None and m.weight.device.type == "cpu",
                        lambda m: FusedTopKRouter(m, ops))
