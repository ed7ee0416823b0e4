"""A grouped GEMM for the GPU tier, in Triton: fixed shapes and no host sync on every GPU Triton runs on.

Why: `torch._grouped_mm` is sync-free only for bf16 on compute capability 9.x/10.x; elsewhere (sm80/86/89, fp16,
fp32) it loops on the host over `offs.cpu()`, a sync per layer per step. Here the (token, slot) pairs are sorted by
slot and each slot's rows padded to a multiple of BLOCK_M (the layout of vLLM's fused-MoE kernel): the padded
length is bounded by P + W * (BLOCK_M - 1), which the host knows from the shapes alone, so the row metadata is
computed on the device and the host queues the launches without waiting, as a CUDA graph needs.

Weights are the pool's slot stacks as they lie, [W, N, K] (a layer's window of slots). FP8 weights are passed as
their bytes and decoded in the kernel, then multiplied by their block scales (W = q * s[n // bn, k // bk], as
tiermoe.experts.fp8_blocks dequantises): Triton on sm80/86 has no e4m3 type, and the weights stay FP8 in memory.
fp32 products use IEEE precision (not TF32), so an fp32 run stays within 1e-5 of torch's.

Under Triton's interpreter (TRITON_INTERPRET=1, how the suite runs this on a CPU) `tl.dot` gets bf16/fp16 operands
wrong, so there they are widened to fp32 first: the same products a tensor core makes (exact products of the
narrow inputs, fp32 sums). Legend: T tokens, P pairs, W slots, N out features, K in features, R padded rows,
B blocks of BLOCK_M rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: torch's CUDA builds bring it; a CPU-only machine never chooses this kernel
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


def available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class GroupedRows:
    """Where each sorted pair's row goes in the padded layout (all on the device, shapes fixed by P and W).

    rows_R: the activation row each padded row reads (-1: padding); pair_row_P: the padded row of each sorted
    pair (R for pairs of no slot here, past the end); block_slot_B: the slot of each block (-1: none)."""

    rows_R: torch.Tensor
    pair_row_P: torch.Tensor
    block_slot_B: torch.Tensor

    @property
    def padded(self) -> int:
        return self.rows_R.shape[0]

    def own_rows(self) -> torch.Tensor:
        """[R] rows for a product over a first product's padded output: each row reads itself (-1: padding)."""
        return torch.where(self.rows_R >= 0, torch.arange(self.padded, device=self.rows_R.device), -1)

    def pair_rows(self, out_RN: torch.Tensor) -> torch.Tensor:
        """[P, N] each sorted pair's row of a padded output (a pair of no slot here: some row, to be dropped)."""
        return out_RN[self.pair_row_P.clamp(max=self.padded - 1)]


def grouped_rows(slot_sorted_P: torch.Tensor, source_P: torch.Tensor, width: int,
                 block_m: int = BLOCK_M) -> GroupedRows:
    """The padded layout of pairs sorted by slot. `slot_sorted_P` [P]: each pair's slot in the window, sorted
    ascending, `width` for a pair of no slot here (those sort last); `source_P` [P]: the activation row each reads."""
    device, pairs = slot_sorted_P.device, slot_sorted_P.shape[0]
    padded = -(-(pairs + width * (block_m - 1)) // block_m) * block_m  # R: any split of P over W slots fits
    sizes_W = torch.zeros(width + 1, dtype=torch.int64, device=device)
    sizes_W.index_add_(0, slot_sorted_P, torch.ones_like(slot_sorted_P))
    sizes_W = sizes_W[:width]
    padded_W = (sizes_W + block_m - 1) // block_m * block_m
    pad_end_W = padded_W.cumsum(0)
    first_W = sizes_W.cumsum(0) - sizes_W  # each slot's first sorted pair
    slot_P = slot_sorted_P.clamp(max=width - 1)
    here_P = slot_sorted_P < width
    rank_P = torch.arange(pairs, device=device) - first_W[slot_P]
    pair_row_P = torch.where(here_P, pad_end_W[slot_P] - padded_W[slot_P] + rank_P, padded)
    rows_R = torch.full((padded + 1,), -1, dtype=torch.int64, device=device)
    rows_R.scatter_(0, pair_row_P, source_P.to(torch.int64))  # pairs of no slot here land in the extra row R
    starts_B = torch.arange(0, padded, block_m, device=device)
    block_slot_B = torch.searchsorted(pad_end_W, starts_B, right=True)
    block_slot_B = torch.where(block_slot_B < width, block_slot_B, -1)
    return GroupedRows(rows_R[:padded].contiguous(), pair_row_P, block_slot_B.contiguous())


def grouped_matmul(x_MK: torch.Tensor, layout: GroupedRows, w_WNK: torch.Tensor, rows_R: torch.Tensor | None = None,
                   scale_Wnk: torch.Tensor | None = None, scale_block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """out [R, N]: padded row r = x[rows_R[r]] @ w[slot of r's block].T (rows of padding are left unwritten).

    `rows_R` defaults to the layout's (the activation rows of the pairs); a second product over the padded
    output of a first passes `layout.own_rows()`. FP8 weights: `w_WNK` holds e4m3 codes and `scale_Wnk`
    their fp32 block scales [W, ceil(N/bn), ceil(K/bk)]."""
    if not available():
        raise RuntimeError("the Triton grouped GEMM needs the triton package")
    rows_R = layout.rows_R if rows_R is None else rows_R
    _, n, k = w_WNK.shape
    out = torch.empty((layout.padded, n), dtype=x_MK.dtype, device=x_MK.device)
    fp8 = scale_Wnk is not None
    w = w_WNK.view(torch.uint8) if fp8 else w_WNK
    scale = scale_Wnk if fp8 else w_WNK  # unused without FP8 (the kernel needs some pointer)
    widen = os.environ.get("TRITON_INTERPRET") == "1" or x_MK.dtype == torch.float32
    grid = (layout.padded // BLOCK_M, -(-n // BLOCK_N))
    _grouped_kernel[grid](
        x_MK, rows_R, layout.block_slot_B, w, scale, out, n, k,
        x_MK.stride(0), x_MK.stride(1), w.stride(0), w.stride(1), w.stride(2),
        scale.stride(0), scale.stride(1) if fp8 else 0, scale.stride(2) if fp8 else 0, out.stride(0),
        SCALE_N=scale_block[0], SCALE_K=scale_block[1], FP8=fp8, WIDEN=widen,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


if triton is not None:

    @triton.jit
    def _e4m3_to_float(q):
        """e4m3fn codes (bytes, as int32) -> their fp32 values (1 sign, 4 exponent bits of bias 7, 3 mantissa)."""
        sign, exponent, mantissa = (q >> 7) & 1, (q >> 3) & 15, (q & 7).to(tl.float32)
        value = tl.where(exponent == 0, mantissa * 0.001953125,  # subnormal: m / 8 * 2^-6
                         (1.0 + mantissa * 0.125) * tl.exp2((exponent - 7).to(tl.float32)))
        return tl.where(sign == 1, -value, value)


    @triton.jit
    def _grouped_kernel(x_ptr, rows_ptr, block_slot_ptr, w_ptr, scale_ptr, out_ptr, N, K,
                        stride_xm, stride_xk, stride_wg, stride_wn, stride_wk, stride_sg, stride_sn, stride_sk,
                        stride_om, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, FP8: tl.constexpr,
                        WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        block, tile = tl.program_id(0), tl.program_id(1)
        slot = tl.load(block_slot_ptr + block)
        if slot >= 0:
            padded_rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            rows = tl.load(rows_ptr + padded_rows)
            valid = rows >= 0
            rows = tl.where(valid, rows, 0).to(tl.int64)
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_slot = w_ptr + slot.to(tl.int64) * stride_wg
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                            mask=valid[:, None] & (ks[None, :] < K), other=0.0)
                w_mask = (ks[:, None] < K) & (cols[None, :] < N)
                w = tl.load(w_slot + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0)
                if FP8:  # dequantised as fp8_blocks does: the fp32 product rounded once to the activations' dtype
                    s = tl.load(scale_ptr + slot.to(tl.int64) * stride_sg + (cols[None, :] // SCALE_N) * stride_sn
                                + (ks[:, None] // SCALE_K) * stride_sk, mask=w_mask, other=0.0)
                    w = (_e4m3_to_float(w.to(tl.int32)) * s).to(x_ptr.dtype.element_ty)
                if WIDEN:
                    acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(x, w)
            tl.store(out_ptr + padded_rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=valid[:, None] & (cols[None, :] < N))
