"""The Triton grouped GEMM of the GPU tier (tiermoe.experts.triton_grouped), run by Triton's interpreter on the CPU
against torch: every dtype the GPU tier computes in, FP8 weights decoded in the kernel, slots with no pairs, pairs
of no slot, and windows that need padding."""

from __future__ import annotations

import pytest
import torch

from tiermoe.experts import triton_grouped
from tiermoe.experts.fp8_blocks import dequantize_fp8, quantize_fp8

pytestmark = pytest.mark.skipif(not triton_grouped.available(), reason="triton is not installed")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def reference(x_TD, slot_P, source_P, w_WNK) -> torch.Tensor:
    """Each pair's product x[source] @ w[slot].T in fp32, then rounded to x's dtype ([P, N]; zero for no slot)."""
    width = w_WNK.shape[0]
    out = torch.zeros(slot_P.shape[0], w_WNK.shape[1])
    for p, (slot, src) in enumerate(zip(slot_P.tolist(), source_P.tolist())):
        if slot < width:
            out[p] = x_TD[src].float() @ w_WNK[slot].float().T
    return out.to(x_TD.dtype)


def pairs(tokens: int, k: int, width: int, seed: int):
    """Sorted pairs: (slot per pair, ascending, `width` = no slot here), (the token each reads)."""
    g = torch.Generator().manual_seed(seed)
    slot_TK = torch.randint(0, width + 1, (tokens, k), generator=g)  # some pairs belong to no slot here
    slot_TK[:, 0] = slot_TK[:, 0].clamp(max=width - 2)  # ... and the last slot may get none at all
    flat = slot_TK.reshape(-1)
    order = flat.argsort(stable=True)
    return flat[order], order // k


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("tokens, k, width, n, d", [(1, 2, 3, 40, 24), (7, 4, 5, 70, 48), (33, 2, 2, 16, 8)])
def test_each_padded_row_is_its_pairs_product(dtype, tokens, k, width, n, d):
    g = torch.Generator().manual_seed(tokens)
    x_TD = torch.randn(tokens, d, generator=g).to(dtype)
    w_WNK = torch.randn(width, n, d, generator=g).to(dtype)
    slot_P, source_P = pairs(tokens, k, width, seed=tokens)
    layout = triton_grouped.grouped_rows(slot_P, source_P, width)
    out_RN = triton_grouped.grouped_matmul(x_TD, layout, w_WNK)
    here_P = slot_P < width
    got = layout.pair_rows(out_RN)
    want = reference(x_TD, slot_P, source_P, w_WNK)
    err = ((got[here_P].float() - want[here_P].float()).abs().max() / want[here_P].float().abs().max()).item()
    assert err <= TOLERANCE[dtype]
    assert bool((layout.pair_row_P[~here_P] == layout.padded).all())
    assert layout.padded % triton_grouped.BLOCK_M == 0 and layout.padded >= slot_P.shape[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_are_decoded_and_scaled_in_the_kernel_as_the_checkpoint_reader_does(dtype):
    g = torch.Generator().manual_seed(1)
    width, n, d, block = 3, 40, 24, (16, 8)  # blocks that do not divide the weight
    codes, scales = zip(*(quantize_fp8(torch.randn(n, d, generator=g), block) for _ in range(width)))
    q_WNK, s_Wnk = torch.stack(codes), torch.stack(scales)
    dense_WNK = torch.stack([dequantize_fp8(q, s, block, dtype) for q, s in zip(codes, scales)])
    x_TD = torch.randn(5, d, generator=g).to(dtype)
    slot_P, source_P = pairs(5, 2, width, seed=2)
    layout = triton_grouped.grouped_rows(slot_P, source_P, width)
    got = triton_grouped.grouped_matmul(x_TD, layout, q_WNK, scale_Wnk=s_Wnk, scale_block=block)
    want = triton_grouped.grouped_matmul(x_TD, layout, dense_WNK)
    rows = layout.pair_row_P[slot_P < width]
    if dtype == torch.float32:
        assert torch.equal(got[rows], want[rows])  # the same dequantised weights, the same products
    else:  # the interpreter rounds fp32 -> bf16 its own way (a GPU rounds to nearest, as torch does): one bf16 step
        err = ((got[rows].float() - want[rows].float()).abs().max() / want[rows].float().abs().max()).item()
        assert err <= TOLERANCE[dtype]


def test_every_e4m3_code_decodes_to_its_value():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN codes: no weight holds them
    w_WNK = codes.view(torch.float8_e4m3fn).reshape(1, -1, 1)  # one output feature per code, K = 1
    one = torch.zeros(1, dtype=torch.int64)
    layout = triton_grouped.grouped_rows(one, one, 1)
    got = triton_grouped.grouped_matmul(torch.ones(1, 1), layout, w_WNK, scale_Wnk=torch.ones(1, 1, 1),
                                        scale_block=(256, 1))
    assert torch.equal(got[0], w_WNK[0, :, 0].float())
