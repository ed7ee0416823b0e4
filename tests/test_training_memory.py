"""A LoRA training step makes no copy of a frozen expert: every heap allocation of a step (forward, backward, AdamW
step) of a tiny model, counted in a child process by a preloaded malloc (tests/allocation_tracking.py), is smaller
than one expert's smallest weight matrix (down, a third of the expert), with the experts on the native CPU tier (the
C++ kernels) and on both tiers. The same count catches a backward that takes a dequantised copy of each expert (what
a tier without kernels does) and one that copies a single stored matrix, so the test can fail.

One kind of allocation is exempt, by the symbol that asked for it: MKL's GEMM workspace (`mkl_serv_allocate`, from
`sgemm_getbufs`), where MKL packs panels of an fp32 product's operands; its size follows MKL's blocking and the
product's width (2I here), not an expert, and no expert of the CPU tier is an operand of a torch product. Nothing
else is exempt: the tiny model's expert matrices (256 KB bf16) are larger than its activations and than its rank-1
adapter's gradients and AdamW state (tests/training_step_allocations.py says why each stays below).
"""

from __future__ import annotations

import pytest
import torch
from allocation_tracking import build_tracker, run_tracked
from training_reference import one_torch_thread  # noqa: F401 (an autouse fixture)
from transformers import AutoConfig

from tiermoe.experts.kernels import supported_isa
from tiermoe.training.context_memory import measure_step_bytes

pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(supported_isa() is None, reason="the kernel library cannot be built here")

EXEMPT = "mkl_serv_allocate"  # MKL's own workspace for a GEMM (see the module docstring)


@pytest.fixture(scope="module")
def step_allocations(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_allocations")
    return run_tracked(build_tracker(out), "training_step_allocations", str(out))


def _not_exempt(big: list[dict]) -> list[dict]:
    return [b for b in big if EXEMPT not in b["stack"]]


@pytest.mark.parametrize("case", ["cpu_tier", "both_tiers"])
def test_a_training_step_allocates_nothing_of_an_expert_matrix_size(step_allocations, case):
    found = step_allocations[case]
    assert found["peak"] > 0  # the counter saw the step
    big = _not_exempt(found["big"])
    assert big == [], f"allocations >= one expert matrix ({step_allocations['matrix_bytes']} bytes): {big}"


@pytest.mark.parametrize("case", ["dequantising_backward", "copying_backward"])
def test_a_backward_that_copies_expert_weights_is_caught(step_allocations, case):
    big = _not_exempt(step_allocations[case]["big"])
    assert big and min(b["bytes"] for b in big) >= step_allocations["matrix_bytes"]


def test_fit_train_predicts_the_bytes_a_token_of_context_takes(step_allocations, tiny_dir):
    """`tiermoe fit --train`'s per-token term (measured on proxies of the model at 128 and 384 tokens, by the
    profiler's allocation events) against the slope of every allocation of the real model's step (the preloaded
    counter, all threads) between 1024 and 2048 tokens: within 10%."""
    context = step_allocations["context"]
    (t1, t2), (p1, p2) = context["tokens"], context["peaks"]
    measured = (p2 - p1) / (t2 - t1)
    path = tiny_dir("qwen3_moe")
    step = measure_step_bytes(AutoConfig.from_pretrained(path), torch.float32, None, rank=4)
    predicted = step.per_token_rest + 3 * step.per_token_layer  # the tiny model's 3 layers
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)
