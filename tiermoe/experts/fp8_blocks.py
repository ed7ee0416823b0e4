"""Block-FP8 math: e4m3 codes with one fp32 scale per block, as DeepSeek-V3 and the Qwen3 FP8 releases store
Linear weights.

A weight W [N, K] is stored as codes q [N, K] plus `weight_scale_inv` s [ceil(N/bn), ceil(K/bk)] (one per block
of bn x bk, 128 x 128 in every release): W = q * s[n // bn, k // bk]. Shared by the model's FP8Linear and the
GPU tier's FP8 experts, so both dequantise exactly as the checkpoint reader does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiermoe.errors import TiermoeError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_BLOCK = (128, 128)


def scale_shape(shape_NK: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    n, k = shape_NK
    return -(-n // block[0]), -(-k // block[1])


def dequantize_fp8(q_NK: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] in `dtype` from e4m3 codes and per-block scales: W = q * s, each product in fp32 and rounded
    once to `dtype`. Written into `out` (contiguous, `dtype`, on q's device) when given.

    Two passes over W and no fp32 copy of it (this runs inside every forward of an FP8 weight): the codes are
    copied into `out` (exact: every e4m3/e5m2 value is a bf16, fp16 and fp32 value), then multiplied in place by
    the fp32 scales (the multiply promotes to fp32 and rounds into `out`)."""
    n, k = q_NK.shape
    bn, bk = block
    if tuple(scale_inv.shape) != scale_shape((n, k), block):
        raise TiermoeError(f"FP8 scale has shape {list(scale_inv.shape)}, expected "
                           f"{list(scale_shape((n, k), block))} for a [{n}, {k}] weight in {bn}x{bk} blocks")
    out = torch.empty((n, k), dtype=dtype, device=q_NK.device) if out is None else out
    out.copy_(q_NK)
    s = scale_inv.to(torch.float32)
    if n % bn == 0 and k % bk == 0:  # whole blocks: broadcast, no expanded scale matrix
        blocks = out.view(n // bn, bn, k // bk, bk)
        torch.mul(blocks, s[:, None, :, None], out=blocks)
    else:
        torch.mul(out, s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k], out=out)
    return out


def dequant_bytes(shape_NK: tuple[int, int], block: tuple[int, int], dtype: torch.dtype) -> int:
    """Memory `dequantize_fp8` holds at its peak for W [N, K]: the output in `dtype`, and where the blocks do not
    divide W, the fp32 scale matrix it expands to W's shape (two steps: [N/bn*bn, K/bk] then [N, K/bk*bk])."""
    n, k = shape_NK
    bn, bk = block
    nb, kb = scale_shape((n, k), block)
    out = n * k * dtype.itemsize
    if n % bn == 0 and k % bk == 0:
        return out
    return out + 4 * (nb * bn * kb + n * kb * bk)


def quantize_fp8(w_NK: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [N, K], scale_inv fp32 [N/bn, K/bk]): each block's max maps to e4m3's largest value, 448.

    How the released checkpoints were made; tiermoe uses it to write test checkpoints in that layout."""
    n, k = w_NK.shape
    bn, bk = block
    nb, kb = scale_shape((n, k), block)
    w = F.pad(w_NK.to(torch.float32), (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    amax = w.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [nb, kb]
    s = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (w / s[:, None, :, None]).to(torch.float8_e4m3fn).view(nb * bn, kb * bk)[:n, :k].contiguous()
    return q, s.contiguous()
