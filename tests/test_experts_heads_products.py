"""Products of a packed matrix's heads in one call (`packed_heads_product`, csrc tm_heads_linear): MLA's W_UK folded
into each head's query (transposed) and W_UV applied to each head's output (forward), against torch's batched
matmuls on the dequantised matrix, on every kernel level this CPU runs and every stored format, with the strided
rows MLAAttention hands them ([M, H, *] views).

Tolerances as tests/test_experts_kernel_matmuls.py's: fp32 activations 1e-5 (summation order), bf16 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

from tiermoe.experts.kernel_matmuls import PackedMatrix, packed_heads_product
from tiermoe.experts.kernels import ISA_NAMES, ThreadTeam, load_kernels, supported_isa
from tiermoe.experts.quant import block, dequantize, quantize

BEST = supported_isa()
KERNEL_ISAS = list(ISA_NAMES[: ISA_NAMES.index(BEST) + 1]) if BEST else []
needs_kernels = pytest.mark.skipif(BEST is None, reason="the kernel library cannot be built here")
H, N, V = 3, 32, 16  # heads, W_UK rows (nope dim) and W_UV rows (value dim) per head


def kv_b(fmt: str, rank: int) -> tuple[PackedMatrix, torch.Tensor, torch.Tensor]:
    """A grouped kv_b_proj [H * (N + V), rank] packed in `fmt`, and its dequantised W_UK [H, N, R], W_UV [H, V, R]."""
    w = torch.randn(H * (N + V), rank, generator=torch.Generator().manual_seed(1)) * 0.1
    q = block(quantize(w, fmt))
    w = dequantize(q, torch.float32)
    return PackedMatrix(q), w[: H * N].view(H, N, rank), w[H * N:].view(H, V, rank)


@needs_kernels
@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "int6"])
@pytest.mark.parametrize("rank", [64, 96])  # 96: int4 / int6 pad K to 128
def test_each_head_takes_its_own_rows_forward_and_transposed(isa, fmt, rank):
    kernels = load_kernels(isa)
    team = ThreadTeam(kernels, 2, [])
    packed, w_uk, w_uv = kv_b(fmt, rank)
    g = torch.Generator().manual_seed(2)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        if dtype == torch.bfloat16 and isa not in (BEST, "avx2"):
            continue
        for m in (1, 5, 20):
            q_MHX = torch.randn(m, H, N + 8, generator=g).to(dtype)[..., :N]  # a query's nope part: strided rows
            out_MHR = torch.full((m, H, rank + 4), float("nan"), dtype=dtype)
            packed_heads_product(kernels, team, packed, q_MHX.transpose(0, 1), 0, N,
                                 out_MHR[..., :rank].transpose(0, 1), transposed=True)
            want = torch.bmm(q_MHX.transpose(0, 1).float(), w_uk)  # [H, M, R]
            assert rel_err(out_MHR[..., :rank].transpose(0, 1).float(), want) < tol, (dtype, m)
            assert out_MHR[..., rank:].isnan().all()  # nothing written past each row's R values

            o_MHR = torch.randn(m, H, rank, generator=g).to(dtype)
            out_MHV = torch.empty(m, H, V, dtype=dtype)
            packed_heads_product(kernels, team, packed, o_MHR.transpose(0, 1), H * N, V, out_MHV.transpose(0, 1))
            want = torch.bmm(o_MHR.transpose(0, 1).float(), w_uv.transpose(1, 2)).transpose(0, 1)
            assert rel_err(out_MHV.float(), want) < tol, (dtype, m)


@needs_kernels
def test_heads_outside_the_matrix_or_of_partial_strips_are_refused():
    kernels = load_kernels()
    team = ThreadTeam(kernels, 1, [])
    packed, _, _ = kv_b("int8", 64)
    x, out = torch.randn(H, 2, 64), torch.empty(H, 2, V)
    packed_heads_product(kernels, team, packed, x, H * N, V, out)  # the last heads of the matrix: fine
    with pytest.raises(ValueError, match=r"do not fit 3 heads of 16 rows of a 144 x 64 matrix from row 112"):
        packed_heads_product(kernels, team, packed, x, H * N + 16, V, out)  # one head past the end
    with pytest.raises(ValueError, match="heads of 8 rows"):
        packed_heads_product(kernels, team, packed, x, 0, 8, torch.empty(H, 2, 8))  # not whole strips
    with pytest.raises(ValueError, match="do not fit"):
        packed_heads_product(kernels, team, packed, x.bfloat16(), 0, V, out)  # dtypes differ
