"""MLA (DeepSeek V2/V3): the cache holds the latent, attention reads it absorbed, results equal transformers'.

fp32 tolerance: rel_err <= 1e-5 against the unmodified transformers model (which expands the past to per-head K/V
and attends with sdpa); the absorbed form sums in another order. Observed on the tiny models: <= 1e-6.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MASKS, load_reference, make_mask, rel_err, run_cli

from tiermoe.arch import detect, load_config
from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.kernels import load_kernels
from tiermoe.layers import mla_math
from tiermoe.layers.mla_attention import MLAAttention
from tiermoe.layers.mla_math import (
    absorbed_attention,
    absorbing_is_cheaper,
    attend_expanded,
    causal_mask,
    group_kv_b_rows,
    split_kv_b,
)
from tiermoe.layers.quantized_linear import QuantizedLinear
from tiermoe.model.plan_source import placement_target
from tiermoe.placement.budget import kv_bytes_per_token
from tiermoe.testing.presets import make_config

FP32_TOL = 1e-5
CPU = torch.device("cpu")
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, mscale=1.0,
            mscale_all_dim=1.0)
# (architecture, config overrides): both rope variants, q_lora_rank set and None, yarn's softmax mscale
VARIANTS = {
    "v2": ("deepseek_v2", {}),  # complex rope, q_lora_rank 48
    "v2-yarn-no-q-lora": ("deepseek_v2", dict(q_lora_rank=None, rope_parameters=YARN)),
    "v3": ("deepseek_v3", {}),  # interleaved rope, q_lora_rank 48
    "v3-rotate-half-no-q-lora": ("deepseek_v3", dict(rope_interleave=False, q_lora_rank=None)),
    "v3-yarn": ("deepseek_v3", dict(rope_parameters=YARN)),
}
# 8 sequences of different lengths; the 40-token one is prefilled in one chunk, long enough to expand the past
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34], [40], list(range(50, 90)),
           list(range(100, 113)), [120, 121, 122], [130, 131, 132, 133, 134, 135, 136]]
GREEDY_TOKENS = 5


def save_variant(path, arch: str, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config(arch, initializer_range=0.1, **overrides),
                                     dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            arch, overrides = VARIANTS[name]
            cache[name] = save_variant(tmp_path_factory.mktemp(name), arch, **overrides)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def reference_greedy(tiny_dir):
    """reference_greedy(arch) -> the unmodified transformers model's greedy tokens for every prompt (computed once:
    they do not depend on the placement)."""
    cache = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            model = load_reference(tiny_dir(arch))
            cache[arch] = [_greedy(model, prompt, GREEDY_TOKENS) for prompt in PROMPTS]
        return cache[arch]

    return get


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_absorbed_attention_equals_expanded_attention_for_every_mask_form():
    g = torch.Generator().manual_seed(0)
    B, H, Q, L, R, P, N, V = 3, 4, 5, 9, 32, 8, 16, 12
    q_nope, q_pe = torch.randn(B, H, Q, N, generator=g), torch.randn(B, H, Q, P, generator=g)
    latent, k_pe = torch.randn(B, L, R, generator=g), torch.randn(B, L, P, generator=g)
    w_kv_b = torch.randn(H * (N + V), R, generator=g) / R**0.5
    # the expansion transformers computes: per-head K = [W_UK c | k_pe], V = W_UV c
    kv = (latent @ w_kv_b.T).view(B, L, H, N + V).transpose(1, 2)
    key = torch.cat((kv[..., :N], k_pe[:, None].expand(-1, H, -1, -1)), dim=-1)
    query = torch.cat((q_nope, q_pe), dim=-1)
    pads = torch.ones(B, L, dtype=torch.bool)
    pads[1, :3] = False  # row 1 left-padded
    allowed = causal_mask(Q, L, CPU) & pads[:, None, None, :]
    additive = torch.zeros(B, 1, Q, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
    w_uk, w_uv = split_kv_b(w_kv_b, H, N)
    grouped = w_kv_b.clone()
    group_kv_b_rows(grouped, H, N)  # rows [W_UK; W_UV]: the same halves, contiguous
    assert all(torch.equal(a, b) and b.is_contiguous() for a, b in zip((w_uk, w_uv), split_kv_b(grouped, H, N, True)))
    for mask, want_allowed in ((None, causal_mask(Q, L, CPU)), (allowed, allowed), (additive, allowed)):
        want = torch.nn.functional.scaled_dot_product_attention(query, key, kv[..., N:], attn_mask=want_allowed,
                                                                scale=0.3)
        got = absorbed_attention(q_nope, q_pe, latent, k_pe, w_uk, w_uv, 0.3, mask)
        assert got.shape == (B, H, Q, V) and rel_err(got, want) <= FP32_TOL
        # query positions in blocks (scores of 2 queries at a time): the same result
        blocked = absorbed_attention(q_nope, q_pe, latent, k_pe, w_uk, w_uv, 0.3, mask,
                                     max_score_bytes=2 * B * H * L * 4)
        assert rel_err(blocked, want) <= FP32_TOL


def test_only_long_chunks_over_a_short_past_expand_it():
    # DeepSeek-V3 / V2-Lite shapes (R 512, N = V = 128): absorbing costs less up to 170 queries per forward
    assert absorbing_is_cheaper(1, 512, 128, 128) and absorbing_is_cheaper(170, 512, 128, 128)
    assert not absorbing_is_cheaper(171, 512, 128, 128)
    v3 = dict(num_heads=128, kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128, itemsize=2)
    assert not attend_expanded(1, 100, **v3) and not attend_expanded(170, 4096, **v3)  # decode, short chunks
    assert attend_expanded(512, 4096, **v3)  # 448 MiB of K/V for this forward
    assert not attend_expanded(512, 8192, **v3)  # 896 MiB: attends from the latent, in blocks of queries


@pytest.mark.exactness
@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_prefill_and_batched_decode_logits_equal_transformers(name, variant_dir):
    path = variant_dir(name)
    ref = load_reference(path)
    mask = make_mask("random_half", detect(load_config(path)))
    with LLM(path, placement=mask, dtype=torch.float32, progress=False) as llm:
        engine = llm.engine
        attn = [layer.self_attn for layer in llm.hybrid.model.model.layers]
        assert all(type(a) is MLAAttention and a.kv_b_grouped for a in attn)
        seqs, ids = [], []
        for prompt in PROMPTS:
            seq, chunk = engine.new_sequence(), 40 if len(prompt) == 40 else 4
            with torch.no_grad():
                want = ref(torch.tensor([prompt])).logits[0]
            for start in range(0, len(prompt), chunk):
                got = engine.feed([seq], [prompt[start:start + chunk]])[0][-1]
                assert rel_err(got, want[min(start + chunk, len(prompt)) - 1]) <= FP32_TOL
            seqs.append(seq)
            ids.append(list(prompt) + [int(want[-1].argmax())])
        for _ in range(3):  # all 8 rows in one forward, a padded batch over the pool
            rows = engine.feed(seqs, [[i[-1]] for i in ids])
            for got, row_ids in zip(rows, ids):
                with torch.no_grad():
                    want = ref(torch.tensor([row_ids])).logits[0, -1]
                assert rel_err(got[-1], want) <= FP32_TOL
                row_ids.append(int(want.argmax()))
        cfg = llm.hybrid.config
        for i in range(len(attn)):  # the pool's slots: [latent | k_pe] per token, no per-head K/V
            k_slots, v_slots = engine.pool.pages._slots[i]
            assert k_slots.shape[1:] == (1, cfg.kv_lora_rank) and v_slots.shape[1:] == (1, cfg.qk_rope_head_dim)


@pytest.mark.exactness
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_greedy_alone_and_batched_equal_transformers_for_every_placement(arch, kind, tiny_dir, reference_greedy):
    path = tiny_dir(arch)
    greedy = SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)
    mask = make_mask(kind, detect(load_config(path)))
    with LLM(path, placement=mask, dtype=torch.float32, max_running=8, prefill_chunk=5, progress=False) as llm:
        together = llm.generate(PROMPTS, greedy)  # prompts prefilled in chunks beside the others' decodes
        for prompt, result, want in zip(PROMPTS, together, reference_greedy(arch)):
            assert result.token_ids == want
            if kind == "random_half":
                assert llm.generate(prompt, greedy)[0].token_ids == want


def test_decode_never_expands_the_past(tiny_dir):
    with LLM(tiny_dir("deepseek_v3"), dtype=torch.float32, progress=False) as llm:
        engine = llm.engine
        expanded = []  # positions kv_b_proj expanded, per call

        def record(module, args, out):
            expanded.append(args[0].shape[-2])

        hooks = [layer.self_attn.kv_b_proj.register_forward_hook(record) for layer in llm.hybrid.model.model.layers]
        try:
            seqs = [engine.new_sequence(), engine.new_sequence()]
            engine.feed([seqs[0]], [list(range(5, 45))])  # a 40-token chunk: worth expanding, for this forward only
            long_chunk, expanded[:] = list(expanded), []
            engine.feed([seqs[1]], [[7, 8, 9]])  # a short chunk attends from the latent
            short_chunk, expanded[:] = list(expanded), []
            engine.feed([seqs[0]], [[50]])  # decode alone
            engine.feed(seqs, [[51], [52]])  # decode batched
            engine.feed(seqs, [[53], [54, 55, 56]])  # a decode beside a short chunk
            assert expanded == []
            assert short_chunk == [] and long_chunk == [48] * len(hooks)  # 40 tokens read as 3 whole pages of 16
        finally:
            for hook in hooks:
                hook.remove()


def test_a_long_chunk_whose_expansion_would_be_too_big_attends_from_the_latent_in_blocks(tiny_dir, monkeypatch):
    path = tiny_dir("deepseek_v2")
    prompt = list(range(5, 85))
    with torch.no_grad():
        want = load_reference(path)(torch.tensor([prompt])).logits[0]
    monkeypatch.setattr(mla_math, "MAX_EXPANSION_BYTES", 1)  # no expansion fits
    monkeypatch.setattr(mla_math, "MAX_SCORE_BYTES", 4 * 4 * 80 * 7)  # float32 scores of 4 heads: 7-14 queries
    with LLM(path, dtype=torch.float32, progress=False) as llm:
        expanded = []
        hooks = [layer.self_attn.kv_b_proj.register_forward_hook(lambda *a: expanded.append(1))
                 for layer in llm.hybrid.model.model.layers]
        seq = llm.engine.new_sequence()
        for start in (0, 40):  # chunks of 40 queries: long enough to be worth expanding
            got = llm.engine.feed([seq], [prompt[start:start + 40]], rows=["all"])[0]
            assert rel_err(got, want[start:start + 40]) <= FP32_TOL
        for hook in hooks:
            hook.remove()
        assert expanded == []


def _v2_lite_shaped(path, layers: int = 2):
    """DeepSeek-V2-Lite's attention shapes (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, no q_lora) with
    toy MoE and vocabulary sizes."""
    from transformers import AutoModelForCausalLM

    cfg = make_config("deepseek_v2", "deepseek-v2-lite", layers=layers, hidden_size=64, intermediate_size=64,
                      moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                      vocab_size=256, max_position_embeddings=256, initializer_range=0.1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_holds_exactly_the_reported_bytes_per_token(dtype, tmp_path):
    path = _v2_lite_shaped(tmp_path / "v2-lite")
    cfg = load_config(path)
    reported = kv_bytes_per_token(cfg, dtype.itemsize)
    assert reported == 2 * (512 + 64) * dtype.itemsize
    assert placement_target(path, dtype).kv_bytes_per_token == reported  # what --gpu-memory-gb plans with
    with LLM(path, dtype=dtype, max_total_tokens=64, progress=False) as llm:
        seq = llm.engine.new_sequence()
        llm.engine.feed([seq], [list(range(3, 14))])
        for token in (20, 21, 22):
            llm.engine.feed([seq], [[token]])
        pages = llm.engine.pool.pages
        tensors = [t for pair in pages._slots.values() for t in pair]
        slots = (pages.num_pages[None] + 1) * pages.page_size  # page 0 included
        assert {tuple(t.shape) for t in tensors} == {(slots, 1, 512), (slots, 1, 64)}  # no per-head K/V
        assert pages.bytes_per_token() == reported and pages.nbytes() == slots * reported


def test_fit_reports_the_latent_for_deepseek_v3_and_gqa_unchanged(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(make_config("deepseek_v3", "deepseek-v3").to_dict()))
    r = run_cli("fit", "--model", str(config), "--dtype", "bf16", "--max-total-tokens", "32768")
    assert r.returncode == 0, r.stderr
    assert "32768 tokens x 70272 B" in r.stdout  # (512 + 64) x 2 bytes x 61 layers, <= 72 KB
    assert kv_bytes_per_token(make_config("qwen3_moe", "qwen3-30b-a3b"), 2) == 98_304


def _decode_logits(path, dtype: torch.dtype, in_place: bool = True, packed: bool = True) -> torch.Tensor:
    """Logits of decode steps: 8 rows of different pasts in one forward (three steps), then two decode rows beside a
    prompt chunk. In bf16 the decode rows attend in place (the kernel's) or, with the step's decode attention taken
    away, on their gathered pages through torch; fp32 MLA rows always take torch's path. A bf16 model holds its
    non-expert linears packed (kv_b_proj's absorbed products on the kernels) unless not `packed`."""
    cpu = CPUConfig(non_expert_dtype=None if packed else "none")
    with LLM(path, dtype=dtype, page_size=4, cpu=cpu, progress=False) as llm:
        engine = llm.engine
        kv_b = engine.model.model.layers[0].self_attn.kv_b_proj
        assert isinstance(kv_b, QuantizedLinear) == (packed and dtype == torch.bfloat16)
        assert (engine.decode_attention is not None) == (dtype == torch.bfloat16)  # bf16 MLA of a few heads
        if not in_place:
            engine.decode_attention = None
        seqs = [engine.new_sequence() for _ in PROMPTS]
        for seq, prompt in zip(seqs, PROMPTS):
            engine.feed([seq], [prompt])
        rows = [torch.stack([r[-1] for r in engine.feed(seqs, [[60 + step]] * len(seqs))]) for step in range(3)]
        mixed = engine.feed(seqs[:2] + [engine.new_sequence()], [[70], [71], [80, 81, 82]])
        rows.append(torch.stack([r[-1] for r in mixed[:2]]))  # the decode rows
        return torch.cat(rows).float()


@pytest.mark.skipif(load_kernels() is None, reason="the CPU kernels are not built here")
@pytest.mark.parametrize("name", ["v2", "v3-yarn"])
def test_bf16_decode_rows_reading_the_latent_in_place_are_as_exact_as_the_gathered_path(name, variant_dir):
    """The kernel's MLA decode (a two-part key read where it lies, tiermoe.layers.decode_attention) against the
    fp32 logits of the same steps: no further from them than torch's absorbed attention on gathered pages."""
    path = variant_dir(name)
    want = _decode_logits(path, torch.float32)
    in_place, gathered = (rel_err(_decode_logits(path, torch.bfloat16, flag), want) for flag in (True, False))
    assert in_place <= 1.25 * gathered  # observed: 0.073 and 0.073 (v2), 0.019 and 0.019 (v3-yarn)


@pytest.mark.skipif(load_kernels() is None, reason="the CPU kernels are not built here")
def test_bf16_decode_with_kv_b_packed_takes_the_absorbed_products_on_the_kernels_as_exact_as_torch(variant_dir):
    """kv_b_proj packed (CPU-only runs): W_UK folded into each head's query and W_UV onto its output by the heads'
    products (tiermoe.experts.kernel_matmuls.packed_heads_product), in place and in prompt chunks, against the fp32
    logits of the same steps: no further from them than torch's bf16 batched matmuls on its views."""
    path = variant_dir("v3-yarn")
    want = _decode_logits(path, torch.float32)
    packed, plain = (rel_err(_decode_logits(path, torch.bfloat16, packed=flag), want) for flag in (True, False))
    assert packed <= 1.25 * plain  # observed: equal (0.0185 both; the tiny heads' sums round alike)
