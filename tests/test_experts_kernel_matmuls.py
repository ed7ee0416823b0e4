"""One expert's four products on the native CPU tier's packed kernels (what training's backward computes with),
against torch on the dequantised expert, on every kernel level this CPU runs and every stored format.

Legend: M rows routed to the expert, D hidden, I intermediate. Shapes: multiples of 64 (no padding), multiples of
16/32 only (K padded to 64 for int4), and for int8 / int4 sizes that are not multiples of 16 (rows padded too).

Tolerances: with fp32 activations the kernels multiply exactly dequantised weights and accumulate in fp32, so only
the summation order differs from torch: 1e-5 of the largest output (the measure of tests/conftest.rel_err). With
bf16 activations each output is rounded once to bf16 (relative up to 2^-8 ~ 4e-3); int8 / int4 weights are rounded
to bf16 too in AMX tiles and in transposed products from 16 rows (strips dequantised for VDPBF16PS; as `tier.get`
in bf16 rounds them), and their forward products on the AVX512-BF16 level quantise the activations to int8 in
blocks of 32 (tests/test_int8_activations.py), so 1e-2 (measured: at most 8.0e-3).
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import rel_err

from tiermoe.experts.expert_matmuls import TorchMatmuls, matmuls_of
from tiermoe.experts.ffn import ExpertActivation
from tiermoe.experts.kernel_matmuls import KernelMatmuls
from tiermoe.experts.kernels import ISA_NAMES, supported_isa
from tiermoe.experts.native import NativeCPUExperts
from tiermoe.experts.tiers import CPUWorker
from tiermoe.experts.weights import ExpertWeights

SILU = ExpertActivation("silu_glu")
BEST = supported_isa()
KERNEL_ISAS = list(ISA_NAMES[: ISA_NAMES.index(BEST) + 1]) if BEST else []
needs_kernels = pytest.mark.skipif(BEST is None, reason="the kernel library cannot be built here")
SHAPES = {  # (D, I) per format: aligned, padded K, padded rows and K
    "bf16": [(128, 64), (96, 32)],
    "int8": [(128, 64), (96, 48), (40, 24)],
    "int4": [(128, 64), (96, 48), (40, 24)],
    "int6": [(128, 64), (96, 48), (40, 24)],
}
CASES = [(fmt, d, i) for fmt, shapes in SHAPES.items() for d, i in shapes]


@pytest.fixture
def worker():
    w = CPUWorker()
    yield w
    w.close()


def expert(d: int, i: int, seed: int = 0, bias: bool = False) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    biases = (torch.randn(2 * i, generator=g), torch.randn(d, generator=g)) if bias else (None, None)
    return ExpertWeights(torch.randn(2 * i, d, generator=g) * 0.1, torch.randn(d, i, generator=g) * 0.1, *biases)


def tier_of(worker, fmt: str, d: int, i: int, isa: str | None = None, threads: int = 2, **kw) -> NativeCPUExperts:
    tier = NativeCPUExperts(worker, SILU, fmt, torch.float32, threads=threads, isa=isa, **kw)
    for e in range(3):
        tier.add(e, expert(d, i, seed=e))
    return tier


def inputs(m: int, d: int, i: int, dtype: torch.dtype, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    widths = {"gate_up": d, "down": i, "gate_up_t": 2 * i, "down_t": d}
    return {name: torch.randn(m, w, generator=g).to(dtype) for name, w in widths.items()}


def check_products(tier: NativeCPUExperts, e: int, d: int, i: int, dtype: torch.dtype, tol: float) -> None:
    ops = tier.matmuls(e, dtype)
    assert isinstance(ops, KernelMatmuls)
    ref = TorchMatmuls(tier.get(e), torch.float32)  # the dequantised expert, fp32
    for m in (1, 5, 40):
        for name, x in inputs(m, d, i, dtype, seed=m).items():
            got = getattr(ops, name)(x)
            want = getattr(ref, name)(x.float())
            assert got.dtype == dtype and got.shape == want.shape, (name, m)
            assert rel_err(got.float(), want) < tol, (name, m, rel_err(got.float(), want))


@needs_kernels
@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("fmt,d,i", CASES)
def test_the_four_products_equal_torch_on_the_dequantised_expert_in_fp32(isa, fmt, d, i, worker):
    tier = tier_of(worker, fmt, d, i, isa=isa)
    assert tier.path == f"kernels/{isa}"
    check_products(tier, 1, d, i, torch.float32, 1e-5)


@needs_kernels
@pytest.mark.parametrize("isa", sorted({BEST, "avx2"} & set(KERNEL_ISAS), key=KERNEL_ISAS.index))
@pytest.mark.parametrize("fmt,d,i", CASES)
def test_bf16_activations_give_bf16_products_within_one_rounding(isa, fmt, d, i, worker):
    # the best level (VDPBF16PS, AMX from 5 rows where the CPU has them) and one without bf16 instructions
    tier = tier_of(worker, fmt, d, i, isa=isa, amx_min_rows=4)
    check_products(tier, 2, d, i, torch.bfloat16, 1e-2)


@needs_kernels
def test_transposed_products_use_w_not_its_transpose_on_square_matrices(worker):
    d, i = 64, 32  # gate_up is [2I, D] = [64, 64]: a transpose would not show in the shape
    tier = tier_of(worker, "bf16", d, i)
    ops, w = tier.matmuls(0, torch.float32), tier.get(0)
    g = torch.randn(7, 2 * i)
    assert rel_err(ops.gate_up_t(g), g @ w.gate_up) < 1e-5
    assert rel_err(ops.gate_up_t(g), g @ w.gate_up.T) > 0.5
    assert rel_err(ops.gate_up(g), g @ w.gate_up.T) < 1e-5


@needs_kernels
def test_biases_are_added_to_the_forward_products_only(worker):
    d, i = 64, 32
    tier = NativeCPUExperts(worker, SILU, "int8", torch.float32, threads=1)
    tier.add(0, expert(d, i, bias=True))
    ops, ref = tier.matmuls(0, torch.float32), TorchMatmuls(tier.get(0), torch.float32)
    for name, x in inputs(4, d, i, torch.float32).items():
        assert rel_err(getattr(ops, name)(x), getattr(ref, name)(x)) < 1e-5, name


@needs_kernels
def test_callable_from_any_thread_while_a_layer_is_in_flight(worker):
    d, i = 128, 64
    tier = tier_of(worker, "int4", d, i, threads=2)
    ops, ref = tier.matmuls(1, torch.float32), TorchMatmuls(tier.get(1), torch.float32)
    x = torch.randn(9, d)
    want = ref.gate_up(x)
    tokens = torch.randn(16, d)
    ids, weights = torch.randint(0, 3, (16, 2)), torch.full((16, 2), 0.5)
    tier.submit(tokens, ids, weights)  # a forward on the worker thread, sharing the thread team
    results = []
    callers = [threading.Thread(target=lambda: results.append(ops.gate_up(x))) for _ in range(3)]
    for t in callers:
        t.start()
    results.append(ops.gate_up(x))
    for t in callers:
        t.join()
    layer = tier.sync()
    on_worker = worker.submit(ops.gate_up, x).result()  # and from the worker thread itself
    assert len(results) == 4 and all(rel_err(r, want) < 1e-5 for r in [*results, on_worker])
    tier.submit(tokens, ids, weights)
    assert torch.equal(tier.sync(), layer)


def test_the_torch_path_has_no_kernel_products_and_matmuls_of_falls_back(worker):
    d, i = 96, 40  # bf16 sizes that are not multiples of 32: rows layout, torch path
    rows = tier_of(worker, "bf16", d, i)
    forced = tier_of(worker, "int4", 128, 64, isa="torch")
    for tier, (dd, ii) in ((rows, (d, i)), (forced, (128, 64))):
        assert tier.path == "torch" and tier.matmuls(0, torch.float32) is None
        ops = matmuls_of(tier, 0, torch.float32)
        assert isinstance(ops, TorchMatmuls)
        x = torch.randn(3, dd)
        assert torch.equal(ops.gate_up(x), x @ tier.get(0).gate_up.T)


@needs_kernels
def test_matmuls_of_uses_the_kernels_on_any_leading_shape_and_refuses_wrong_widths(worker):
    tier = tier_of(worker, "int8", 128, 64)
    ops, ref = matmuls_of(tier, 2, torch.float32), TorchMatmuls(tier.get(2), torch.float32)
    assert isinstance(ops, KernelMatmuls)
    x = torch.randn(2, 3, 128)
    assert ops.gate_up(x).shape == (2, 3, 128) and rel_err(ops.gate_up(x), ref.gate_up(x)) < 1e-5
    assert ops.down_t(torch.empty(0, 128)).shape == (0, 64)
    with pytest.raises(ValueError, match="rows of 64 values"):
        ops.down(x)  # down takes I = 64 columns
    with pytest.raises(KeyError):
        tier.matmuls(7, torch.float32)
