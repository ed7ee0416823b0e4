"""The Triton kernels of tiermoe.experts.triton_grouped (imported on first use: importing triton costs a CPU-only
run time it never needs). See that module for the layout and why."""

import triton
import triton.language as tl


@triton.jit
def _e4m3_to_float(q):
    """e4m3fn codes (bytes, as int32) -> their fp32 values (1 sign, 4 exponent bits of bias 7, 3 mantissa)."""
    sign, exponent, mantissa = (q >> 7) & 1, (q >> 3) & 15, (q & 7).to(tl.float32)
    value = tl.where(exponent == 0, mantissa * 0.001953125,  # subnormal: m / 8 * 2^-6
                     (1.0 + mantissa * 0.125) * tl.exp2((exponent - 7).to(tl.float32)))
    return tl.where(sign == 1, -value, value)


@triton.jit
def grouped_kernel(x_ptr, rows_ptr, block_slot_ptr, w_ptr, scale_ptr, out_ptr, N, K,
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
