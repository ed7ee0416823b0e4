"""FusedRMSNorm: transformers' RMSNorm modules as one native call (tiermoe.experts.layer_ops) instead of eight
torch ops (to, pow, mean, add, rsqrt, mul, to, mul), bit for bit the same result; FusedRMSNormGated likewise for
Qwen3-Next's gated norm (eleven ops).

A decode step of a small or CPU-resident model is bound by the host's per-op dispatch (about 5 us an op here):
every decoder layer runs two norms, four with Qwen3's q/k norms, so these are a quarter of a layer's ops.
`fuse_norms` swaps one in for each RMSNorm module whose weight lives on the CPU, the way HybridMoE replaces MoE
blocks; the weight Parameter is taken over (same object, same name), so state dicts and adapters see no change.

The reference classes (NORM_FORMS takes every class with one of their code too: tiermoe.arch.code_form) and where
their weight meets the normalised row x * rsqrt(mean(x^2) + eps), computed in fp32:
  weight * h.to(dtype)              Qwen2/3-MoE, Mixtral, DeepSeek-V2/V3, GLM-4-MoE, OLMoE
  (weight * h).to(dtype)            GPT-OSS
  (h * (1 + weight.float())).to(dtype)   Qwen3-Next
  (weight * h.to(dtype) * silu(gate.float())).to(dtype)   Qwen3-Next's gated norm, in its linear attention

The native call applies to CPU inputs in bf16 / fp32 of at most NATIVE_MAX_ROWS rows with no gradient to track
(the gated norm: a contiguous gate of fewer than TORCH_GRAIN_SIZE elements, on a torch CPU capability whose silu
is replicated, LayerOps.exp_lanes); anything else (a long prefill, which torch spreads over threads; fp16;
autograd) computes transformers' formula in torch, with the same result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.arch.code_form import CodeForms
from tiermoe.experts.layer_ops import (
    CAST_AFTER_WEIGHT,
    NATIVE_DTYPES,
    ONE_PLUS_WEIGHT,
    TORCH_GRAIN_SIZE,
    WEIGHT_TIMES_CAST,
    LayerOps,
)
from tiermoe.layers.module_swap import swap_modules

# Decode batches: the native call is single-threaded; longer inputs are worth torch's threads.
NATIVE_MAX_ROWS = 64

_MODELS = "transformers.models"
# (module, class) -> (norm kind, the attribute holding eps); a class with the same code as one of these is taken too
# (tiermoe.arch.code_form: most families' RMSNorm is Qwen3-MoE's under another name)
NORM_FORMS = CodeForms({
    **{(f"{_MODELS}.{arch}.modeling_{arch}", name): (WEIGHT_TIMES_CAST, "variance_epsilon") for arch, name in (
        ("qwen3_moe", "Qwen3MoeRMSNorm"), ("qwen2_moe", "Qwen2MoeRMSNorm"), ("mixtral", "MixtralRMSNorm"),
        ("deepseek_v2", "DeepseekV2RMSNorm"), ("deepseek_v3", "DeepseekV3RMSNorm"), ("glm4_moe", "Glm4MoeRMSNorm"),
        ("olmoe", "OlmoeRMSNorm"))},
    (f"{_MODELS}.gpt_oss.modeling_gpt_oss", "GptOssRMSNorm"): (CAST_AFTER_WEIGHT, "variance_epsilon"),
    (f"{_MODELS}.qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNorm"): (ONE_PLUS_WEIGHT, "eps"),
})
GATED_NORM_FORMS = CodeForms({(f"{_MODELS}.qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNormGated"): True})


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: int) -> torch.Tensor:
    """Transformers' formula of `kind`, op for op (the path for inputs the native call does not take)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if kind == WEIGHT_TIMES_CAST:
        return weight * h.to(dtype)
    if kind == CAST_AFTER_WEIGHT:
        return (weight * h).to(dtype)
    return (h * (1.0 + weight.float())).type_as(x)


class FusedRMSNorm(nn.Module):
    """Replaces `norm` (of one of NORM_FORMS), sharing its weight."""

    def __init__(self, norm: nn.Module, ops: LayerOps):
        super().__init__()
        self.kind, eps_attr = NORM_FORMS.of(type(norm))
        self.eps = float(getattr(norm, eps_attr))
        self.weight = norm.weight
        self.ops = ops
        self.replaced = type(norm).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.device.type == "cpu" and w.device.type == "cpu" and x.dtype in NATIVE_DTYPES and w.dtype in NATIVE_DTYPES
                and x.dim() > 0 and x.shape[-1] == w.shape[0] and x.numel() <= NATIVE_MAX_ROWS * x.shape[-1]
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return self.ops.rms_norm(x, w, self.eps, self.kind)
        return reference_rms_norm(x, w, self.eps, self.kind)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, replaces={self.replaced}"


class FusedRMSNormGated(nn.Module):
    """Replaces `norm` (a Qwen3NextRMSNormGated with the silu activation), sharing its weight."""

    def __init__(self, norm: nn.Module, ops: LayerOps):
        super().__init__()
        self.eps = float(norm.variance_epsilon)
        self.weight = norm.weight
        self.ops = ops

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x, w = hidden_states, self.weight
        if (self.ops.exp_lanes is not None and x.device.type == "cpu" and gate.device.type == "cpu"
                and w.device.type == "cpu" and x.dtype in NATIVE_DTYPES and w.dtype in NATIVE_DTYPES
                and gate.dtype in NATIVE_DTYPES and x.dim() > 0 and gate.shape == x.shape and gate.is_contiguous()
                and x.shape[-1] == w.shape[0] and x.numel() < TORCH_GRAIN_SIZE
                and x.numel() <= NATIVE_MAX_ROWS * x.shape[-1]
                and not (torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad or w.requires_grad))):
            return self.ops.rms_norm_gated(x, gate, w, self.eps)
        return reference_rms_norm_gated(x, gate, w, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, replaces=Qwen3NextRMSNormGated"


def reference_rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3NextRMSNormGated's formula, op for op."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.to(torch.float32))).to(dtype)


def fuse_norms(model: nn.Module, ops: LayerOps) -> int:
    """Swap a FusedRMSNorm in for every module of NORM_FORMS in `model` whose weight is on the CPU, and a
    FusedRMSNormGated for every gated one; returns how many were swapped."""
    def wanted(module: nn.Module) -> bool:
        gated = GATED_NORM_FORMS.of(type(module)) is not None and module.activation == "silu"
        return (NORM_FORMS.of(type(module)) is not None or gated) and module.weight.device.type == "cpu"

    def replacement(module: nn.Module) -> nn.Module:
        fused = FusedRMSNorm if NORM_FORMS.of(type(module)) is not None else FusedRMSNormGated
        return fused(module, ops)

    return swap_modules(model, wanted, replacement)
