"""int8 / int4 weights times bf16 activations on the AVX512-BF16 level, where the activations are quantised to
int8 in blocks of 32 columns and multiplied in integers (csrc/int8_activations.inc).

The kernels' results equal a torch emulation of that quantisation (on the dequantised weights, in fp32) within one
bf16 rounding of the output. The activations hold an outlier in every block of 32, so the quantisation's own error
is large (tens of percent against the unquantised product): a kernel that skipped it, misplaced a column or a block
scale, or mishandled int4's zero points, would be far outside the bound. fp32 activations keep the exact kernels
(tests/test_experts_cpu_backends.py checks them at 1e-5 on this level too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from tiermoe.experts.expert_matmuls import TorchMatmuls
from tiermoe.experts.ffn import ExpertActivation, routed_experts_forward
from tiermoe.experts.kernels import ISA_NAMES, supported_isa
from tiermoe.experts.native import NativeCPUExperts
from tiermoe.experts.tiers import CPUWorker
from tiermoe.experts.weights import ExpertWeights

SILU = ExpertActivation("silu_glu")
ISA = "avx512bf16"
BEST = supported_isa()
pytestmark = pytest.mark.skipif(BEST is None or ISA_NAMES.index(BEST) < ISA_NAMES.index(ISA),
                                reason="this CPU has no AVX512-BF16 / VNNI kernels")
ONE_BF16_ROUNDING = 2.0**-8 * 1.25  # of the largest output, with room for fp32 summation order


@pytest.fixture
def worker():
    w = CPUWorker()
    yield w
    w.close()


def quantised(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels see it: int8 codes in blocks of 32 columns (scale max |x| / 127, rounded to
    nearest even), dequantised."""
    k = x.shape[1]
    blocks = F.pad(x.float(), (0, -k % 32)).reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape[0], -1)[:, :k]


OUTLIERS = slice(5, None, 32)  # one column per block of 32


def with_outliers(m: int, k: int, seed: int) -> torch.Tensor:
    """Every other value of a block is quantised in steps of 100 / 127."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, OUTLIERS] = 100.0
    return x.to(torch.bfloat16)


def expert(d: int, i: int, seed: int) -> ExpertWeights:
    """Random weights with the outlier columns zero, so the outliers do not swamp the outputs' scale."""
    g = torch.Generator().manual_seed(seed)
    w = ExpertWeights(torch.randn(2 * i, d, generator=g) * 0.1, torch.randn(d, i, generator=g) * 0.1)
    w.gate_up[:, OUTLIERS] = 0.0
    w.down[:, OUTLIERS] = 0.0
    return w


@pytest.mark.parametrize("fmt", ["int8", "int4", "int6"])
@pytest.mark.parametrize("d,i", [(128, 64), (96, 48), (40, 24)])
def test_products_equal_the_emulated_quantisation_within_one_bf16_rounding(fmt, d, i, worker):
    tier = NativeCPUExperts(worker, SILU, fmt, torch.float32, threads=2, isa=ISA)
    tier.add(0, expert(d, i, seed=1))
    ops, ref = tier.matmuls(0, torch.bfloat16), TorchMatmuls(tier.get(0), torch.float32)
    for m in (1, 3, 5, 40):
        for name, width in (("gate_up", d), ("down", i)):
            x = with_outliers(m, width, seed=m)
            got = getattr(ops, name)(x).float()
            want = getattr(ref, name)(quantised(x))
            assert rel_err(got, want) < ONE_BF16_ROUNDING, (name, m, rel_err(got, want))
            assert rel_err(got, getattr(ref, name)(x.float())) > 0.03, (name, m)  # the test can tell


@pytest.mark.parametrize("fmt", ["int8", "int4", "int6"])
def test_a_layer_quantises_its_input_and_its_intermediate(fmt, worker):
    d, i, e, t = 96, 48, 4, 6
    tier = NativeCPUExperts(worker, SILU, fmt, torch.float32, threads=2, isa=ISA)
    for x in range(e):
        tier.add(x, expert(d, i, seed=x))
    x = with_outliers(t, d, seed=7)
    g = torch.Generator().manual_seed(8)
    ids = torch.rand(t, e, generator=g).topk(2, dim=1).indices
    w = torch.softmax(torch.randn(t, 2, generator=g), dim=1)
    tier.submit(x, ids, w)
    got = tier.sync().float()
    want = torch.zeros(t, d)
    for ex in range(e):
        tok, slot = torch.where(ids == ex)
        if len(tok):
            weights = tier.get(ex)
            h = SILU(F.linear(quantised(x[tok]), weights.gate_up))
            want.index_add_(0, tok, F.linear(quantised(h), weights.down) * w[tok, slot, None])
    assert rel_err(got, want) < ONE_BF16_ROUNDING, rel_err(got, want)
    exact = routed_experts_forward({ex: tier.get(ex) for ex in range(e)}, x.float(), ids, w, SILU)
    assert rel_err(got, exact) > 0.03  # the test can tell
