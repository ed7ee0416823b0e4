"""The fused per-layer ops of the kernel library (csrc/layer_ops.cpp): RMSNorm, Qwen3-Next's gated RMSNorm, the
softmax top-k routers' tail and DeepSeek / GLM's grouped routers' tail, each one native call computing bit for bit
what transformers' torch code computes on this CPU.

Bit-exactness needs torch's summation order, which depends on the vector width torch's CPU kernels were
dispatched for (`torch.backends.cpu.get_cpu_capability()`): sums use 8 lanes on every x86-64 capability (the sum
kernel is registered without AVX-512); softmax, sigmoid and silu, which use SLEEF's exp, 16 with AVX-512 and 8 with
AVX2. Torch's DEFAULT capability computes exp otherwise: the routers and the gated norm are not replicated there
(`exp_lanes` None).

Outputs are allocated here (one torch op each); the inputs must be on the CPU, bf16 or fp32, last dim contiguous.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tiermoe.experts.kernels import native_library

# torch CPU capability -> (sum lanes, exp lanes); measured against torch, see tests/test_layers_fused_ops.py
_LANES = {"AVX512": (8, 16), "AVX2": (8, 8), "DEFAULT": (8, None)}
# torch runs an elementwise op on one thread below this many elements (at::internal::GRAIN_SIZE): then its vector
# loop splits the whole input into SLEEF's exp and libm's as the native silu and sigmoid do
TORCH_GRAIN_SIZE = 32768
NATIVE_DTYPES = (torch.float32, torch.bfloat16)
# Norm kinds (csrc/layer_ops.cpp NormKind): where the weight meets the normalised row
WEIGHT_TIMES_CAST, CAST_AFTER_WEIGHT, ONE_PLUS_WEIGHT = 0, 1, 2


@dataclass(frozen=True)
class LayerOps:
    lib: ctypes.CDLL
    sum_lanes: int
    exp_lanes: int | None  # softmax's, sigmoid's and silu's vector width; None: not replicated on this capability

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, kind: int) -> torch.Tensor:
        """RMSNorm of `x` [..., n] with `weight` [n] (both CPU, bf16 / fp32, x's last dim contiguous), as
        transformers' module of that `kind` computes it; the result is contiguous."""
        n = x.shape[-1]
        row_stride = _row_stride(x)
        if row_stride is None:
            x = x.contiguous()
            row_stride = n
        # torch's promotion of (weight, x) for WEIGHT_TIMES_CAST, spelled out: torch.promote_types is a dispatched op
        out_dtype = torch.float32 if kind == WEIGHT_TIMES_CAST and weight.dtype != x.dtype else x.dtype
        out = torch.empty(x.shape, dtype=out_dtype)
        bf16 = torch.bfloat16
        rows = x.numel() // max(n, 1)
        rc = self.lib.tm_rms_norm(x.data_ptr(), row_stride, weight.data_ptr(), out.data_ptr(), rows, n, eps, kind,
                                  x.dtype == bf16, weight.dtype == bf16, out_dtype == bf16, self.sum_lanes)
        if rc != 0:
            raise RuntimeError(f"tm_rms_norm failed ({rc})")
        return out

    def rms_norm_gated(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Qwen3-Next's gated RMSNorm of `x` [..., n] (last dim contiguous) times silu of the contiguous `gate` of
        x's shape, in x's dtype (all on the CPU, bf16 / fp32; fewer than TORCH_GRAIN_SIZE elements; needs
        `exp_lanes`)."""
        n = x.shape[-1]
        row_stride = _row_stride(x)
        if row_stride is None:
            x = x.contiguous()
            row_stride = n
        out = torch.empty(x.shape, dtype=x.dtype)
        bf16 = torch.bfloat16
        rc = self.lib.tm_rms_norm_gated(x.data_ptr(), row_stride, gate.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                        x.numel() // max(n, 1), n, eps, x.dtype == bf16, gate.dtype == bf16,
                                        weight.dtype == bf16, self.sum_lanes, self.exp_lanes)
        if rc != 0:
            raise RuntimeError(f"tm_rms_norm_gated failed ({rc})")
        return out

    def softmax_topk(self, logits: torch.Tensor, k: int, renormalize: bool, weights_dtype: torch.dtype,
                     topk_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in `weights_dtype`, ids [T, k] int64) of softmax(float(logits)) -> top-k (sorted)
        -> optionally divided by their sum, or with `topk_first` (GPT-OSS) of top-k(logits) -> softmax over the k
        (`renormalize` unused), for contiguous CPU `logits` [T, E]; needs `exp_lanes`."""
        rows, n = logits.shape
        weights = torch.empty(rows, k, dtype=weights_dtype)
        ids = torch.empty(rows, k, dtype=torch.int64)
        bf16 = torch.bfloat16
        rc = self.lib.tm_softmax_topk(logits.data_ptr(), rows, n, k, logits.dtype == bf16, renormalize,
                                      weights_dtype == bf16, self.exp_lanes, self.sum_lanes, topk_first,
                                      weights.data_ptr(), ids.data_ptr())
        if rc != 0:
            raise RuntimeError(f"tm_softmax_topk failed ({rc})")
        return weights, ids

    def grouped_topk(self, logits: torch.Tensor, k: int, sigmoid: bool, bias: torch.Tensor | None, n_group: int,
                     topk_group: int, renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, ids [T, k] int64) of DeepSeek-V2/V3 / GLM-4-MoE's routing from contiguous fp32 CPU
        `logits` [T, E] (csrc/layer_ops.cpp tm_grouped_topk; needs `exp_lanes`; with `sigmoid`, fewer than
        TORCH_GRAIN_SIZE logits)."""
        rows, n = logits.shape
        weights = torch.empty(rows, k, dtype=torch.float32)
        ids = torch.empty(rows, k, dtype=torch.int64)
        rc = self.lib.tm_grouped_topk(logits.data_ptr(), rows, n, k, sigmoid, None if bias is None else bias.data_ptr(),
                                      n_group, topk_group, renormalize, scale, self.exp_lanes, self.sum_lanes,
                                      weights.data_ptr(), ids.data_ptr())
        if rc != 0:
            raise RuntimeError(f"tm_grouped_topk failed ({rc})")
        return weights, ids


def load_layer_ops() -> LayerOps | None:
    """The fused ops, or None without the kernel library (no compiler, TIERMOE_CPU_ISA=torch) or on a torch CPU
    capability whose summation order is not replicated."""
    lib = native_library()
    lanes = _LANES.get(torch.backends.cpu.get_cpu_capability())
    if lib is None or lanes is None:
        return None
    return LayerOps(lib, *lanes)


def _row_stride(x: torch.Tensor) -> int | None:
    """Elements between consecutive rows of `x` [..., n] seen as [rows, n] (last dim contiguous), or None when
    its leading dims do not collapse into one strided dim."""
    if x.dim() == 0 or (x.stride(-1) != 1 and x.shape[-1] > 1):
        return None
    stride, span = None, None  # the innermost leading dim's stride; elements one step of the outer dims must skip
    for size, step in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
        if size == 1:
            continue
        if stride is None:
            stride, span = step, step * size
        elif step != span:
            return None
        else:
            span = step * size
    return x.shape[-1] if stride is None else stride
