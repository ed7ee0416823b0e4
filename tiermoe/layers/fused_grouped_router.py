"""FusedGroupedRouter: DeepSeek-V2/V3 and GLM-4-MoE's routers with their tail as one native call
(tiermoe.experts.layer_ops.grouped_topk) instead of about twenty torch ops, bit for bit the same result: the same
weights and the same ids in the same order (their top-k is unsorted; the call runs torch's algorithm, so the order
is torch's, ties included).

The routers (the linear stays torch's, in fp32 as theirs: `F.linear(x.float(), weight.float())`):
  DeepSeek-V3, GLM-4-MoE: sigmoid scores; choice = scores + e_score_correction_bias; groups ranked by the sum of
    their top-2 choices, the top `topk_group` kept; top-k of the choices; weights = the scores there, renormalised
    when `norm_topk_prob` (sum + 1e-20); times routed_scaling_factor
  DeepSeek-V2: softmax scores; "greedy": top-k; "group_limited_greedy": groups ranked by their max, the others'
    scores zeroed, top-k; times routed_scaling_factor
`fuse_grouped_routers` swaps one in for each such router whose weight lives on the CPU, sharing its weight and
correction bias. The native call applies to CPU logits of at most NATIVE_MAX_ROWS rows (sigmoid: fewer than
TORCH_GRAIN_SIZE logits, below which torch computes it on one thread), an fp32 bias, no gradient to track, on a
torch CPU capability whose exp is replicated (LayerOps.exp_lanes); anything else computes the transformers code in
torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.arch.code_form import CodeForms
from tiermoe.experts.layer_ops import TORCH_GRAIN_SIZE, LayerOps
from tiermoe.layers.lora_stack import LoRAStack
from tiermoe.layers.module_swap import swap_modules

NATIVE_MAX_ROWS = 64  # as fused_norm: longer inputs are worth torch's threads

_MODELS = "transformers.models"
# (module, class) -> whether its scores are sigmoids (DeepSeek-V3's kind) rather than a softmax (DeepSeek-V2's); a
# class with the same code as one of these is taken too (tiermoe.arch.code_form)
GROUPED_ROUTER_FORMS = CodeForms({(f"{_MODELS}.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter"): True,
                                  (f"{_MODELS}.glm4_moe.modeling_glm4_moe", "Glm4MoeTopkRouter"): True,
                                  (f"{_MODELS}.deepseek_v2.modeling_deepseek_v2", "DeepseekV2TopkRouter"): False})
V2_METHODS = ("greedy", "group_limited_greedy")


class FusedGroupedRouter(nn.Module):
    """Replaces `router` (of one of GROUPED_ROUTER_FORMS: `grouped` holds), sharing its weight and bias. `ops` None:
    the tail in torch (a router swapped in only to take an adapter per request, tiermoe.model.served_adapters)."""

    def __init__(self, router: nn.Module, ops: LayerOps | None):
        super().__init__()
        self.sigmoid = GROUPED_ROUTER_FORMS.of(type(router))
        self.top_k, self.num_experts, self.hidden_dim = router.top_k, router.num_experts, router.hidden_dim
        self.scale = float(router.routed_scaling_factor)
        self.weight = router.weight
        if self.sigmoid:
            self.n_group, self.topk_group = router.num_group, router.topk_group
            self.renormalize = bool(router.norm_topk_prob)
            self.register_buffer("e_score_correction_bias", router.e_score_correction_bias)
        else:
            grouped = router.topk_method == "group_limited_greedy"
            self.n_group, self.topk_group = (router.num_group, router.topk_group) if grouped else (1, 1)
            self.renormalize = False
            self.e_score_correction_bias = None
        self.ops = ops
        self.replaced = type(router).__name__
        self.lora: LoRAStack | None = None  # adapters served per request with LoRA on this router (per row)

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        if self.lora is not None and self.lora.rows.active:
            delta = self.lora.delta(hidden_states)
            logits = logits if delta is None else logits + delta.float()
        bias = self.e_score_correction_bias
        if (self.ops is not None and self.ops.exp_lanes is not None and logits.device.type == "cpu"
                and logits.shape[0] <= NATIVE_MAX_ROWS
                and not (self.sigmoid and logits.numel() >= TORCH_GRAIN_SIZE)
                and (bias is None or (bias.device.type == "cpu" and bias.dtype == torch.float32
                                      and bias.is_contiguous()))
                and not (torch.is_grad_enabled() and logits.requires_grad)):
            weights, ids = self.ops.grouped_topk(logits, self.top_k, self.sigmoid, bias, self.n_group,
                                                 self.topk_group, self.renormalize, self.scale)
        elif self.sigmoid:
            weights, ids = self._sigmoid_reference(logits)
        else:
            weights, ids = self._softmax_reference(logits)
        return logits, weights, ids

    def _sigmoid_reference(self, logits):
        """DeepseekV3TopkRouter / Glm4MoeTopkRouter's tail, op for op."""
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * self.scale, ids

    def _softmax_reference(self, logits):
        """DeepseekV2TopkRouter's tail, op for op."""
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if self.n_group > 1 or self.topk_group > 1:  # group_limited_greedy
            per_group = self.num_experts // self.n_group
            group_scores = scores.view(-1, self.n_group, per_group).max(dim=-1).values
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
            scores = scores.masked_fill(~score_mask.bool(), 0.0)
        weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.scale, ids

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, groups={self.topk_group}/{self.n_group}, "
                f"replaces={self.replaced}")


def fuse_grouped_routers(model: nn.Module, ops: LayerOps) -> int:
    """Swap a FusedGroupedRouter in for every `grouped` router in `model` whose weight is on the CPU; returns how
    many were swapped."""
    return swap_modules(model, lambda m: grouped(m) and m.weight.device.type == "cpu",
                        lambda m: FusedGroupedRouter(m, ops))


def grouped(module: nn.Module) -> bool:
    """Whether `module` is a router FusedGroupedRouter computes: one of GROUPED_ROUTER_FORMS (DeepSeek-V2's only
    with greedy or group-limited greedy top-k)."""
    sigmoid = GROUPED_ROUTER_FORMS.of(type(module))
    return sigmoid is not None and (sigmoid or getattr(module, "topk_method", None) in V2_METHODS)
