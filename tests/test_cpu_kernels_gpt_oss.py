"""GPT-OSS's experts on the native CPU kernels: clamped SwiGLU with per-expert biases, every ISA the CPU has and
every stored format, against the torch reference (one layer) and against transformers (a tiny GPT-OSS model).

The data are scaled so that some gate and up values pass +-limit (7): a kernel that skipped a clamp, a bias or
the (up + 1) would be off by far more than the tolerances, which are those of the SiLU-GLU kernels' tests
(tests/test_experts_cpu_backends.py). Against transformers' own checkpoint, int4 is not compared: the format's
own error on the tiny GPT-OSS is beyond that test's 0.25 on the torch path too (measured: 0.27 of the largest
logit for the plain tiny model, 0.74 with this file's scaled gate_up; the tiny Qwen3-MoE's is 0.06). Every format
is compared, at the kernels' own tolerance, with the transformers model whose experts hold what the CPU tier holds
(dequantised), as tests/test_training_native_gradients.py does.
Legend: T tokens, D hidden, I intermediate, E experts, K top-k.
"""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference, rel_err, save_tiny
from test_experts_cpu_backends import assert_tier_matches_reference, run
from training_reference import one_torch_thread  # noqa: F401 (an autouse fixture: tiny torch work, one thread)

from tiermoe.arch import detect, load_config
from tiermoe.config import CPUConfig
from tiermoe.experts.expert_matmuls import TorchMatmuls
from tiermoe.experts.ffn import ExpertActivation, routed_experts_forward
from tiermoe.experts.kernel_matmuls import KernelMatmuls
from tiermoe.experts.kernels import ISA_NAMES, supported_isa
from tiermoe.experts.native import NativeCPUExperts
from tiermoe.experts.tiers import CPUWorker
from tiermoe.experts.weights import ExpertWeights
from tiermoe.model.loader import load_hybrid_model

BEST = supported_isa()
pytestmark = pytest.mark.skipif(BEST is None, reason="the kernel library cannot be built here")
ISAS = ISA_NAMES[: ISA_NAMES.index(BEST) + 1] if BEST else ()
FORMATS = ("bf16", "int8", "int4", "int6")
GPT_OSS = ExpertActivation("gpt_oss_glu")  # alpha 1.702, limit 7, as the releases
GATE_UP_SCALE = 5.0  # on the tiny model's gate_up weights (biases ~ N(0, 1)): some gate / up values pass +-7


@pytest.fixture(autouse=True)
def teams_share_every_job(monkeypatch):
    """Small experts would run on a team's caller alone (kernels.SOLO_BYTES); these reach the helpers too."""
    monkeypatch.setenv("TIERMOE_TEAM_SOLO_BYTES", "0")


@pytest.fixture(scope="module")
def worker():
    w = CPUWorker()
    yield w
    w.close()


def gpt_oss_experts(d: int, i: int, e: int, seed: int = 0) -> dict[int, ExpertWeights]:
    """Experts whose gate / up products (x ~ N(0, 1)) have a spread of about 4: a few percent pass +-7."""
    g = torch.Generator().manual_seed(seed)
    return {n: ExpertWeights(torch.randn(2 * i, d, generator=g) * 0.4, torch.randn(d, i, generator=g) * 0.1,
                             torch.randn(2 * i, generator=g), torch.randn(d, generator=g)) for n in range(e)}


def routing(t: int, d: int, e: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    ids[0, 0] = -1  # a pair of the GPU tier
    return torch.randn(t, d, generator=g), ids, torch.softmax(torch.randn(t, k, generator=g), dim=1)


def clamped_share(experts: dict[int, ExpertWeights], x_TD: torch.Tensor, limit: float) -> tuple[float, float]:
    """The shares of gate values above `limit` and of up values beyond +-limit, over every expert."""
    gate_up = torch.stack([torch.nn.functional.linear(x_TD, w.gate_up, w.gate_up_bias) for w in experts.values()])
    gate, up = gate_up.chunk(2, dim=-1)
    return (gate > limit).float().mean().item(), (up.abs() > limit).float().mean().item()


def held_tier(worker, fmt: str, isa: str, experts: dict[int, ExpertWeights], act=GPT_OSS) -> NativeCPUExperts:
    tier = NativeCPUExperts(worker, act, fmt, torch.float32, threads=2, isa=isa)
    for n, w in experts.items():
        tier.add(n, w)
    return tier


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_gpt_oss_layer_on_the_kernels_matches_the_torch_reference(isa, fmt, worker):
    # D = 96: int4's padded K (128) and down's rows (96) differ; I = 48 pads the gate and up blocks (and biases)
    d, i, e, k = 96, 64 if fmt == "bf16" else 48, 8, 2
    tier = held_tier(worker, fmt, isa, gpt_oss_experts(d, i, e))
    assert tier.path == f"kernels/{isa}"
    held = {n: tier.get(n) for n in range(e)}  # what the tier holds, dequantised, biases included
    bf16_math = isa == "amx" or (isa == "avx512bf16" and fmt == "bf16")  # as the SiLU-GLU tests
    for t in (1, 3, 24):
        x, ids, w = routing(t, d, e, k, seed=t)
        if t > 1:
            gate_share, up_share = clamped_share(held, x, GPT_OSS.limit)
            assert gate_share > 0.01 and up_share > 0.01, (gate_share, up_share)
        assert_tier_matches_reference(tier, held, x, ids, w, GPT_OSS, bf16_math, t)


@pytest.mark.parametrize("isa", ISAS)
def test_the_kernels_take_alpha_and_limit_from_the_activation_and_each_part_counts(isa, worker):
    """Another alpha and limit are computed as given (not the releases' constants), and the reference without
    the clamp, without the biases or with SiLU-GLU is far outside the tolerance: the comparisons can fail."""
    d, i, e, k = 64, 32, 4, 2
    experts = gpt_oss_experts(d, i, e, seed=3)
    x, ids, w = routing(6, d, e, k, seed=4)
    act = ExpertActivation("gpt_oss_glu", alpha=1.0, limit=3.0)
    tier = held_tier(worker, "int8", isa, experts, act)
    y = run(tier, x, ids, w)
    held = {n: tier.get(n) for n in range(e)}
    ref = routed_experts_forward(held, x, ids, w, act)
    tol = 1e-5 if isa != "amx" else 1e-2
    assert rel_err(y, ref) < tol
    unclamped = ExpertActivation("gpt_oss_glu", alpha=1.0, limit=float("inf"))
    unbiased = {n: ExpertWeights(ws.gate_up, ws.down) for n, ws in held.items()}
    for wrong in (routed_experts_forward(held, x, ids, w, unclamped),
                  routed_experts_forward(held, x, ids, w, GPT_OSS),
                  routed_experts_forward(unbiased, x, ids, w, act),
                  routed_experts_forward(held, x, ids, w, ExpertActivation("silu_glu"))):
        assert rel_err(y, wrong) > 0.05


def test_the_training_products_of_a_gpt_oss_expert_add_its_biases(worker):
    """KernelMatmuls (LoRA training's backward through the CPU tier) on the packed weights, biases included."""
    experts = gpt_oss_experts(96, 48, 2)
    tier = held_tier(worker, "int8", BEST, experts)
    mm = tier.matmuls(1, torch.float32)
    assert isinstance(mm, KernelMatmuls)
    ref = TorchMatmuls(tier.get(1), torch.float32)
    g = torch.Generator().manual_seed(2)
    x_ND, a_NI, g_N2I, g_ND = (torch.randn(5, n, generator=g) for n in (96, 48, 96, 96))
    assert rel_err(mm.gate_up(x_ND), ref.gate_up(x_ND)) < 1e-5
    assert rel_err(mm.down(a_NI), ref.down(a_NI)) < 1e-5
    assert rel_err(mm.gate_up_t(g_N2I), ref.gate_up_t(g_N2I)) < 1e-5
    assert rel_err(mm.down_t(g_ND), ref.down_t(g_ND)) < 1e-5
    no_bias = TorchMatmuls(ExpertWeights(ref.w.gate_up, ref.w.down), torch.float32)
    assert rel_err(mm.gate_up(x_ND), no_bias.gate_up(x_ND)) > 0.05  # the biases count


def test_mismatched_biases_are_refused_in_one_line(worker):
    tier = NativeCPUExperts(worker, GPT_OSS, "bf16", torch.float32, threads=1, isa=BEST)
    w = gpt_oss_experts(64, 32, 1)[0]
    with pytest.raises(ValueError, match=r"biases have shapes \[63\], \[64\]; expected gate_up \[64\] and down"):
        tier.add(0, ExpertWeights(w.gate_up, w.down, w.gate_up_bias[:63], w.down_bias))


# -- a tiny GPT-OSS model against transformers ------------------------------------------------------------------

@pytest.fixture(scope="module")
def clamping_gpt_oss(tmp_path_factory):
    """A tiny GPT-OSS checkpoint (I = 64, a multiple of 32 as the bf16 kernels take) whose gate_up weights are
    scaled and gate_up biases drawn from N(0, 1), so that some gate / up values pass +-7; its transformers logits,
    those without the clamp, and the shares of gate / up values the clamp met at each experts call."""
    src = save_tiny("gpt_oss", tmp_path_factory.mktemp("gpt_oss_src"), sizes={"intermediate_size": 64})
    model = load_reference(src)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(GATE_UP_SCALE)
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 1, generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("gpt_oss_clamping")
    model.save_pretrained(path)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    seen = []  # (share of gate > limit, share of |up| > limit) at each experts call
    for layer in model.model.layers:
        experts = layer.mlp.experts

        def recording(gate_up, experts=experts):
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            limit = experts.limit
            seen.append(((gate > limit).float().mean().item(), (up.abs() > limit).float().mean().item()))
            return type(experts)._apply_gate(experts, gate_up)

        experts._apply_gate = recording
    with torch.no_grad():
        ref = model(ids).logits
        for layer in model.model.layers:
            layer.mlp.experts.limit = float("inf")
        unclamped = model(ids).logits
    return path, ids, ref, unclamped, seen


MODEL_TOL = {"bf16": 1e-2, "int8": 3e-2}  # tests/test_experts_cpu_backends.py, the model on the native backend


def holding_the_cpu_tier(path, hybrid) -> torch.nn.Module:
    """Transformers' model of `path` whose routed experts on the CPU tier are what that tier holds (dequantised),
    written back into GPT-OSS's own layout (gate_up [H, 2I] with gate and up columns interleaved, down [I, H])."""
    model = load_reference(path)
    with torch.no_grad():
        for layer, block in hybrid.blocks.items():
            experts = model.model.layers[layer].mlp.experts
            for e in block.cpu_tier.experts:
                w = block.cpu_tier.get(e)
                gate, up = w.gate_up.chunk(2)
                experts.gate_up_proj[e, :, 0::2], experts.gate_up_proj[e, :, 1::2] = gate.T, up.T
                bias_gate, bias_up = w.gate_up_bias.chunk(2)
                experts.gate_up_proj_bias[e, 0::2], experts.gate_up_proj_bias[e, 1::2] = bias_gate, bias_up
                experts.down_proj[e].copy_(w.down.T)
                experts.down_proj_bias[e].copy_(w.down_bias)
    return model


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tiny_gpt_oss_model_on_the_kernels_gives_transformers_logits(fmt, isa, clamping_gpt_oss, monkeypatch):
    path, ids, ref, unclamped, seen = clamping_gpt_oss
    assert max(g for g, _ in seen) > 0.01 and max(u for _, u in seen) > 0.01  # the clamp is reached
    assert rel_err(unclamped, ref) > 0.1  # so a kernel without it fails here
    monkeypatch.setenv("TIERMOE_CPU_ISA", isa)
    spec = detect(load_config(path))
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    mask[spec.moe_layers[0], :3] = True  # some experts on the GPU tier (here: the host)
    with torch.no_grad(), load_hybrid_model(path, mask, dtype=torch.float32, progress=False,
                                            cpu=CPUConfig(expert_dtype=fmt, threads=2)) as hybrid:
        assert all(b.cpu_tier.path == f"kernels/{isa}" for b in hybrid.blocks.values())
        logits = hybrid(input_ids=ids).logits
        if fmt in MODEL_TOL:
            assert rel_err(logits, ref) < MODEL_TOL[fmt]
        held_ref = holding_the_cpu_tier(path, hybrid)(ids).logits
        bf16_math = isa == "amx" or (isa == "avx512bf16" and fmt == "bf16")
        assert rel_err(logits, held_ref) < (1e-2 if bf16_math else 1e-5)
