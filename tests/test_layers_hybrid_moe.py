"""The hybrid core: every architecture, every placement, gives the unmodified transformers model's logits."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import ARCHS, MASKS, load_reference, make_mask, rel_err, save_tiny

from tiermoe.arch import detect, load_config
from tiermoe.engine.llm import LLM
from tiermoe.model.loader import load_hybrid_model

FP32_TOL = 1e-5


def input_ids(vocab: int = 256) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.exactness
@pytest.mark.parametrize("arch", ARCHS)
def test_any_mask_gives_reference_logits(arch, tiny_dir):
    path = tiny_dir(arch)
    ref_model = load_reference(path)
    ids = input_ids()
    with torch.no_grad():
        ref = ref_model(ids).logits
    spec = detect(load_config(path))
    for kind in MASKS:
        with load_hybrid_model(path, make_mask(kind, spec), dtype=torch.float32, progress=False) as hybrid:
            assert torch.equal(hybrid.mask, make_mask(kind, spec) & spec.moe_row_mask()[:, None])
            assert rel_err(hybrid(input_ids=ids).logits, ref) < FP32_TOL, kind


@pytest.mark.exactness
@pytest.mark.parametrize("arch", ARCHS)
def test_routed_experts_matter_so_the_comparison_can_fail(arch, tiny_dir):
    """Zeroing one tier's experts must move the logits far beyond the tolerance used above."""
    path = tiny_dir(arch)
    ids = input_ids()
    with load_hybrid_model(path, None, dtype=torch.float32, progress=False) as hybrid:
        ref = hybrid(input_ids=ids).logits
        for block in hybrid.blocks.values():
            for w in block.cpu_tier.experts.values():
                w.down.zero_()
        assert rel_err(hybrid(input_ids=ids).logits, ref) > 100 * FP32_TOL


@pytest.mark.exactness
def test_special_routers_are_exact(tiny_dir):
    """DeepSeek-V3 with n_group > 1 and topk_group > 1, Qwen2-MoE's shared-expert gate, GPT-OSS biases and clamp."""
    v3 = detect(load_config(tiny_dir("deepseek_v3")))
    assert "n_group=4, topk_group=2" in v3.router_kind and v3.shared_kind == "plain"
    assert detect(load_config(tiny_dir("qwen2_moe"))).shared_kind == "gated"
    oss = detect(load_config(tiny_dir("gpt_oss")))
    assert oss.expert_bias and oss.activation == "gpt_oss_glu" and oss.returns_router_scores


@pytest.mark.parametrize("layout", ["fused", "sharded"])
def test_fused_and_sharded_checkpoints_load(layout, tmp_path):
    kwargs = {"save_original_format": False} if layout == "fused" else {"max_shard_size": "100KB"}
    path = save_tiny("qwen3_moe", tmp_path / layout, **kwargs)
    if layout == "sharded":
        assert (path / "model.safetensors.index.json").exists()
    ref_model = load_reference(path)
    ids = input_ids()
    with torch.no_grad():
        ref = ref_model(ids).logits
    spec = detect(load_config(path))
    with load_hybrid_model(path, make_mask("random_half", spec), dtype=torch.float32, progress=False) as hybrid:
        assert rel_err(hybrid(input_ids=ids).logits, ref) < FP32_TOL


def test_cpu_backend_gets_exactly_the_cpu_pairs_on_another_thread(tiny_dir):
    path = tiny_dir("deepseek_v3")
    spec = detect(load_config(path))
    mask = make_mask("random_half", spec)
    with load_hybrid_model(path, mask, dtype=torch.float32, progress=False) as hybrid:
        routed, submitted = {}, {}
        caller = threading.get_ident()
        for layer, block in hybrid.blocks.items():
            router = block._modules[spec.router_attr]
            router.register_forward_hook(lambda m, i, out, layer=layer: routed.__setitem__(layer, out[2].clone()))
            compute = block.cpu_tier._compute

            def spy(x, ids, w, layer=layer, compute=compute):
                submitted[layer] = (ids.clone(), threading.get_ident())
                return compute(x, ids, w)

            block.cpu_tier._compute = spy
        hybrid(input_ids=input_ids())
        assert set(submitted) == set(spec.moe_layers)
        for layer in spec.moe_layers:
            ids_TK = routed[layer]
            expected = {(t, int(e)) for t, row in enumerate(ids_TK) for e in row if not mask[layer, e]}
            got_ids, thread = submitted[layer]
            got = {(t, int(e)) for t, row in enumerate(got_ids) for e in row if e >= 0}
            assert got == expected
            assert len(got) > 0
            assert thread != caller


@pytest.mark.parametrize("arch, on_worker", [("qwen3_moe", False), ("deepseek_v3", True)])
def test_an_all_cpu_layer_hands_its_experts_to_the_worker_only_to_overlap_shared_ones(arch, on_worker, tiny_dir):
    """With every expert on the CPU tier and no shared experts there is nothing to run meanwhile: the CPU tier
    computes on the calling thread (a hand-off costs two thread wake-ups a layer); with shared experts it runs on
    the worker while they compute. Logits exact either way (test_any_mask_gives_reference_logits, all_cpu)."""
    path = tiny_dir(arch)
    with load_hybrid_model(path, None, dtype=torch.float32, progress=False) as hybrid:
        threads = set()
        for block in hybrid.blocks.values():
            compute = block.cpu_tier._compute

            def spy(x, ids, w, compute=compute):
                threads.add(threading.get_ident())
                return compute(x, ids, w)

            block.cpu_tier._compute = spy
        hybrid(input_ids=input_ids())
    assert len(threads) == 1 and (threading.get_ident() not in threads) == on_worker


def test_tier_bytes_equal_the_mask_share(tiny_dir):
    path = tiny_dir("qwen3_moe")
    spec = detect(load_config(path))
    mask = make_mask("random_half", spec) & spec.moe_row_mask()[:, None]
    with load_hybrid_model(path, mask, dtype=torch.float32, progress=False) as hybrid:
        per_expert = spec.bytes_per_expert(torch.float32)
        tb = hybrid.tier_bytes()
        assert tb.gpu_experts == int(mask.sum()) * per_expert
        assert tb.cpu_experts == (spec.total_routed_experts - int(mask.sum())) * per_expert
        ref = load_reference(path)
        ref_bytes = sum(t.numel() * t.element_size() for t in [*ref.parameters(), *ref.buffers()])
        assert tb.non_expert + tb.gpu_experts + tb.cpu_experts == ref_bytes


@pytest.mark.exactness
@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
def test_tier_swap_keeps_logits_exact_and_releases_the_source(arch, tiny_dir):
    """The CPU tier releases what it gives up; the GPU tier's pool keeps a demoted expert's slot for the next
    promotion (its size is the GPU budget)."""
    path = tiny_dir(arch)
    spec = detect(load_config(path))
    ids = input_ids()
    with torch.no_grad():
        ref = load_reference(path)(ids).logits
    layer = spec.moe_layers[-1]
    per_expert = spec.bytes_per_expert(torch.float32)
    with load_hybrid_model(path, None, dtype=torch.float32, progress=False) as hybrid:
        before = hybrid.tier_bytes()
        assert hybrid.move_experts(layer, [0, 3, 5], to_gpu=True) == 3 * per_expert
        after = hybrid.tier_bytes()
        assert before.cpu_experts - after.cpu_experts == 3 * per_expert
        assert after.gpu_experts - before.gpu_experts == 3 * per_expert
        assert hybrid.mask[layer].nonzero().flatten().tolist() == [0, 3, 5]
        assert rel_err(hybrid(input_ids=ids).logits, ref) < FP32_TOL

        hybrid.move_experts(layer, [3], to_gpu=False)  # its GPU slot stays in the pool, free for the next one in
        assert hybrid.tier_bytes().gpu_experts == 3 * per_expert and hybrid.gpu_pool.free_slots == 1
        assert hybrid.tier_bytes().cpu_experts == after.cpu_experts + per_expert
        assert rel_err(hybrid(input_ids=ids).logits, ref) < FP32_TOL
        hybrid.move_experts(layer, [1], to_gpu=True)
        assert hybrid.tier_bytes().gpu_experts == 3 * per_expert and hybrid.gpu_pool.free_slots == 0

        target = make_mask("random_half", spec)
        hybrid.apply_mask(target)
        assert torch.equal(hybrid.mask, target & spec.moe_row_mask()[:, None])
        assert rel_err(hybrid(input_ids=ids).logits, ref) < FP32_TOL

        with pytest.raises(ValueError, match="not on the GPU tier"):
            hybrid.move_experts(layer, [int((~hybrid.mask[layer]).nonzero()[0])], to_gpu=False)


def test_bf16_checkpoint_keeps_its_dtype(tmp_path):
    from tiermoe.testing.make_model import make_model

    path = make_model("mixtral", tmp_path / "bf16", dtype=torch.bfloat16, progress=False)
    with load_hybrid_model(path, None, progress=False) as hybrid:
        spec = hybrid.spec
        assert spec.dtype == torch.bfloat16
        assert hybrid.tier_bytes().cpu_experts == spec.total_routed_experts * spec.bytes_per_expert(torch.bfloat16)
        logits = hybrid(input_ids=input_ids()).logits
        assert torch.isfinite(logits).all()


def test_a_one_row_step_keeps_shared_experts_on_the_kernel_team_beside_its_cpu_tier(tiny_dir):
    """CPU-only bf16 with packed non-experts (the default there): the shared experts' products run on the kernel
    team the CPU tier computes on, so a one-row step computes both on the calling thread (no hand-off); the same
    logits as through the worker, and longer steps still hand off."""
    with LLM(tiny_dir("deepseek_v3"), dtype=torch.bfloat16, progress=False) as llm:
        hybrid = llm.hybrid
        assert all(block.shared_on_team for block in hybrid.blocks.values())
        threads = []
        for block in hybrid.blocks.values():
            compute = block.cpu_tier._compute

            def spy(x, ids, w, compute=compute):
                threads.append((x.shape[0], threading.get_ident()))
                return compute(x, ids, w)

            block.cpu_tier._compute = spy
        one_row = input_ids()[:1, :1]
        here = hybrid(input_ids=one_row).logits
        hybrid(input_ids=input_ids()[:1])  # 9 rows
        for block in hybrid.blocks.values():
            block.shared_on_team = False
        handed_off = hybrid(input_ids=one_row).logits
    caller = threading.get_ident()
    rows_and_here = [(rows, thread == caller) for rows, thread in threads]
    moe_layers = len(hybrid.blocks)
    assert rows_and_here == [(1, True)] * moe_layers + [(9, False)] * moe_layers + [(1, False)] * moe_layers
    assert torch.equal(here, handed_off)
