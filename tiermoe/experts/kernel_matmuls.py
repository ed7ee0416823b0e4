"""Products with packed matrices on the native kernels: one expert's four (tiermoe.experts.expert_matmuls), and
`packed_product`, which also computes the quantised non-expert linears (tiermoe.layers.quantized_linear).

What training's backward through the CPU tier computes with: gate_up / down (x W^T, raw, no activation) and their
input gradients gate_up_t / down_t (g W). The frozen weights are read in the format the tier holds them (bf16,
int8 or int4 strips, csrc/tm_kernels.h) by `tm_linear_forward` / `tm_linear_transposed` (csrc/expert_linear.cpp),
never dequantised as a whole expert; accumulation is fp32. fp32 activations get fp32 products on exactly
dequantised weights; bf16 activations get bf16 products (VDPBF16PS / AMX where the CPU has them; forward products
of int8 / int4 weights on AVX512-BF16 CPUs quantise the activations to int8 in blocks of 32: docs/cpu-backends.md).

Any thread may call (the training loop, autograd's thread, the tier's CPU worker): each call runs on the model's
kernel thread team with the caller as its first member, unpinned, and the team's own lock orders it with the
layers the worker computes. Results carry no autograd history: the callers are backward passes that compute
gradients explicitly. Legend: M rows routed to the expert, D hidden, I intermediate.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from tiermoe.experts.kernels import (
    Kernels,
    ThreadTeam,
    TmHeadsArgs,
    TmLinearArgs,
    TmMatrix,
)
from tiermoe.experts.quant import FORMAT_CODES, QMatrix

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # other activation dtypes are computed in fp32 and cast back


def c_matrix(m: QMatrix | None) -> TmMatrix:
    """The kernels' view of a "blocked" matrix (all zeros for None: an empty table entry)."""
    if m is None:
        return TmMatrix()
    ptr = (lambda t: t.data_ptr() if t is not None else None)
    n_pad, k_pad = m.codes.shape[0] * 16, m.codes.shape[1] * 2
    return TmMatrix(ptr(m.codes), ptr(m.scale), ptr(m.gscale), ptr(m.gzero), n_pad, k_pad, FORMAT_CODES[m.fmt])


class PackedMatrix:
    """W [n, k] as a tier holds it for the kernels, and where its real rows sit among the padded ones: each
    segment's rows at the start of its own block of `segment_rows` (gate_up: gate rows, then up rows)."""

    def __init__(self, m: QMatrix):
        if m.layout != "blocked":
            raise ValueError("the kernels read matrices in the blocked layout")
        length = m.segments[0][1] - m.segments[0][0]
        if any(seg != (i * length, (i + 1) * length) for i, seg in enumerate(m.segments)):
            raise ValueError(f"segments {m.segments} are not equal consecutive blocks of rows")
        self.q = m  # keeps the stored tensors alive while the products use them
        self.c = c_matrix(m)
        self.c_ptr = ctypes.pointer(self.c)  # made once: a decode step calls each non-expert linear once per layer
        self.n, self.k, self.seg_rows, self.seg_len = m.n, m.k, m.segment_rows, length


class KernelMatmuls:
    """The ExpertMatmuls of one expert held by a NativeCPUExperts tier (made by `NativeCPUExperts.matmuls`).

    team: gives the model's kernel thread team (made on first use); biases are added in torch, in `dtype`."""

    def __init__(self, kernels: Kernels, team: Callable[[], ThreadTeam], gate_up: QMatrix, down: QMatrix,
                 gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, dtype: torch.dtype,
                 amx_min_rows: int):
        self.kernels, self.team, self.amx_min_rows = kernels, team, amx_min_rows
        self.w_gate_up, self.w_down = PackedMatrix(gate_up), PackedMatrix(down)
        self.gate_up_bias = None if gate_up_bias is None else gate_up_bias.to(dtype)
        self.down_bias = None if down_bias is None else down_bias.to(dtype)

    def gate_up(self, x_ND: torch.Tensor) -> torch.Tensor:
        return _plus(self._product(self.w_gate_up, x_ND, transposed=False), self.gate_up_bias)

    def down(self, a_NI: torch.Tensor) -> torch.Tensor:
        return _plus(self._product(self.w_down, a_NI, transposed=False), self.down_bias)

    def gate_up_t(self, g_N2I: torch.Tensor) -> torch.Tensor:
        return self._product(self.w_gate_up, g_N2I, transposed=True)

    def down_t(self, g_ND: torch.Tensor) -> torch.Tensor:
        return self._product(self.w_down, g_ND, transposed=True)

    def _product(self, w: PackedMatrix, x: torch.Tensor, transposed: bool) -> torch.Tensor:
        return packed_product(self.kernels, self.team(), w, x, transposed, self.amx_min_rows)


def packed_product(kernels: Kernels, team: ThreadTeam, w: PackedMatrix, x: torch.Tensor, transposed: bool = False,
                   amx_min_rows: int = 4) -> torch.Tensor:
    """x W^T ([..., k] -> [..., n]) or, transposed, x W ([..., n] -> [..., k]), in x's dtype, on `team`.

    The one entry to `tm_linear_forward` / `tm_linear_transposed`: an expert's products (KernelMatmuls) and the
    quantised non-expert linears (tiermoe.layers.quantized_linear) both compute through it."""
    width_in, width_out = (w.n, w.k) if transposed else (w.k, w.n)
    if x.device.type != "cpu" or x.shape[-1] != width_in:
        raise ValueError(f"expected CPU rows of {width_in} values, got {tuple(x.shape)} on {x.device}")
    compute = x.dtype if x.dtype in KERNEL_DTYPES else torch.float32
    rows = x.detach().reshape(-1, width_in).to(compute).contiguous()
    out = torch.empty(rows.shape[0], width_out, dtype=compute)
    if rows.shape[0] == 0:
        return out.view(*x.shape[:-1], width_out).to(x.dtype)
    args = TmLinearArgs(isa=kernels.isa, amx_min_rows=amx_min_rows, M=rows.shape[0], N=w.n, K=w.k,
                        seg_rows=w.seg_rows, seg_len=w.seg_len, x_bf16=int(compute == torch.bfloat16),
                        W=w.c_ptr, x=rows.data_ptr(), out=out.data_ptr())
    call = kernels.lib.tm_linear_transposed if transposed else kernels.lib.tm_linear_forward
    err = ctypes.create_string_buffer(256)
    if call(team.handle, ctypes.byref(args), err, len(err)) != 0:
        raise RuntimeError(err.value.decode())
    return out.view(*x.shape[:-1], width_out).to(x.dtype)


def packed_heads_product(kernels: Kernels, team: ThreadTeam, w: PackedMatrix, x_HMi: torch.Tensor, first_row: int,
                         head_rows: int, out_HMo: torch.Tensor, transposed: bool = False,
                         amx_min_rows: int = 4) -> None:
    """Per head h, x[h] W_h^T (or, transposed, x[h] W_h) into out[h], where W_h is `head_rows` rows of w from row
    first_row + h * head_rows: H products in one call (`tm_heads_linear`). x [H, M, in] and out [H, M, out] may be
    strided views (e.g. of [M, H, *] rows) with contiguous last dims, both fp32 or both bf16; head_rows and
    first_row are multiples of 16, within w's real rows (one segment)."""
    H, M, width_in = x_HMi.shape
    width_out = w.k if transposed else head_rows
    if (x_HMi.dtype not in KERNEL_DTYPES or out_HMo.dtype != x_HMi.dtype or x_HMi.stride(-1) != 1
            or out_HMo.stride(-1) != 1 or out_HMo.shape != (H, M, width_out)
            or width_in != (head_rows if transposed else w.k) or head_rows % 16 or first_row % 16
            or w.seg_len != w.n or first_row + H * head_rows > w.n):
        raise ValueError(f"heads' products of {tuple(x_HMi.shape)} {x_HMi.dtype} rows into "
                         f"{tuple(out_HMo.shape)} {out_HMo.dtype} do not fit {H} heads of {head_rows} rows of a "
                         f"{w.n} x {w.k} matrix from row {first_row}")
    one = TmLinearArgs(isa=kernels.isa, amx_min_rows=amx_min_rows, M=M, N=head_rows, K=w.k, seg_rows=head_rows,
                       seg_len=head_rows, x_bf16=int(x_HMi.dtype == torch.bfloat16), W=w.c_ptr,
                       x=x_HMi.data_ptr(), out=out_HMo.data_ptr())
    args = TmHeadsArgs(one=one, H=H, first_strip=first_row // 16, transposed=int(transposed),
                       x_row=x_HMi.stride(1), x_head=x_HMi.stride(0), out_row=out_HMo.stride(1),
                       out_head=out_HMo.stride(0))
    err = ctypes.create_string_buffer(256)
    if kernels.lib.tm_heads_linear(team.handle, ctypes.byref(args), err, len(err)) != 0:
        raise RuntimeError(err.value.decode())


def _plus(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)
