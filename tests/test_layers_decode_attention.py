"""Decode rows attending the KV pool in place (tiermoe.layers.decode_attention, csrc/paged_attention.cpp).

The reference is the attention transformers computes for each row alone: its visible keys gathered, softmax over
the scaled scores (with GPT-OSS's sink logits appended and dropped). fp32 within 1e-5 relative (sums in another
order); bf16 rows within 2 bf16 steps of the fp32 result of the same bf16 inputs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb as glm_rotary
from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as gpt_oss_rotary
from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

from tiermoe.arch import load_config
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.kernels import ISA_NAMES, ThreadTeam, load_kernels
from tiermoe.layers import decode_attention as decode_module
from tiermoe.layers.decode_attention import DecodeAttention
from tiermoe.layers.ragged_step import RaggedStep, SeqFeed
from tiermoe.testing.op_counter import OpCounter

KERNELS = load_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels are not built here")


def _reference(q_THd, k_SHd, v_SHd, tables, pos, lo, page_size, scale, sinks_H):
    """Each row alone: its visible keys gathered, softmax in fp32, GQA by repeating KV heads."""
    rows = []
    H, Hkv = q_THd.shape[1], k_SHd.shape[1]
    for t in range(q_THd.shape[0]):
        keys = torch.arange(int(lo[t]), int(pos[t]) + 1)
        slots = tables[t][keys // page_size] * page_size + keys % page_size
        k = k_SHd[slots].float().repeat_interleave(H // Hkv, dim=1)  # [n, H, d]
        v = v_SHd[slots].float().repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q_THd[t].float(), k) * scale
        if sinks_H is not None:
            scores = torch.cat([scores, sinks_H.float()[:, None]], dim=1)
        probs = scores.softmax(dim=-1)[:, :len(keys)]
        rows.append(torch.einsum("hn,nhd->hd", probs, v))
    return torch.stack(rows)


def _case(dtype, sinks: bool, seed: int = 0, d: int = 16, dv: int | None = None):
    """Four rows: one key, a few, and two long rows (more keys than the kernel's block of 32) with sliding
    windows; head sizes that are not a multiple of 16 leave the kernel a tail."""
    g = torch.Generator().manual_seed(seed)
    page_size, pages, Hkv, H, dv = 4, 48, 2, 6, dv or d
    k = torch.randn(pages * page_size, Hkv, d, generator=g).to(dtype)
    v = torch.randn(pages * page_size, Hkv, dv, generator=g).to(dtype)
    pos = torch.tensor([0, 5, 93, 150], dtype=torch.int32)
    lo = torch.tensor([0, 0, 7, 101], dtype=torch.int32)  # the last two rows see a sliding window
    perm = torch.randperm(pages - 1, generator=g) + 1  # page 0 stays unused, as in the pool
    tables = torch.stack([perm[i:i + 40] for i in range(4)])  # [4, 40] page ids, each row's own order
    q = torch.randn(H, 4, d, generator=g).to(dtype).transpose(0, 1)  # strided as transformers' [1, H, T, d] rows
    sinks_H = torch.randn(H, generator=g).to(dtype) if sinks else None
    return q, k, v, tables, pos, lo, page_size, d ** -0.5, sinks_H


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("team", [False, True])
def test_rows_attend_their_own_pages_and_window_as_transformers_does(dtype, sinks, team, monkeypatch):
    q, k, v, tables, pos, lo, page_size, scale, sinks_H = _case(dtype, sinks)
    if team:  # work this small runs on the calling thread unless the threshold says otherwise
        monkeypatch.setattr(decode_module, "TEAM_MIN_KV_BYTES", 0)
    threads = ThreadTeam(KERNELS, 2)
    _check_attention(KERNELS, lambda: threads, dtype, _case(dtype, sinks))
    assert (threads.shared_jobs > 0) == team  # the helper worked only when the threshold let it
    threads.close()


@needs_kernels
@pytest.mark.parametrize("isa", ISA_NAMES[:KERNELS.isa + 1] if KERNELS else [])
def test_every_isa_attends_every_head_size(isa):
    """Each ISA's vector code (SSE2, AVX2, AVX-512: the CPU may run any of them), head sizes with and without a
    tail of fewer than 16 lanes, values narrower than keys."""
    kernels = load_kernels(isa=isa)
    for dtype in (torch.float32, torch.bfloat16):
        for d, dv in ((16, 16), (64, 64), (72, 72), (128, 128), (48, 40)):
            _check_attention(kernels, None, dtype, _case(dtype, sinks=d == 64, seed=d, d=d, dv=dv))


def _mla_case(dtype, seed: int, R: int, P: int, H: int = 6):
    """Absorbed MLA's shape of the same rows: one KV head, a key of two parts (latent R, roped P: K and KR slots),
    the latent as the value."""
    q, latent, _, tables, pos, lo, page_size, _, _ = _case(dtype, sinks=False, seed=seed, d=R)
    g = torch.Generator().manual_seed(seed + 1)
    latent = latent[:, :1].contiguous()
    k_pe = torch.randn(latent.shape[0], 1, P, generator=g).to(dtype)
    q = torch.randn(H, 4, R + P, generator=g).to(dtype).transpose(0, 1)
    return q, latent, k_pe, tables, pos, lo, page_size, (R + P) ** -0.5


@needs_kernels
@pytest.mark.parametrize("isa", ISA_NAMES[:KERNELS.isa + 1] if KERNELS else [])
@pytest.mark.parametrize("threads", [1, 16])
def test_a_two_part_key_whose_first_part_is_the_value_attends_as_absorbed_mla(isa, threads, monkeypatch):
    """MLA's decode: every head scores [latent | k_pe] and sums the latent, read from two slot tensors in place.
    16 threads for 4 rows of one KV head split each row's keys in 4 ranges, merged after (the one-key row leaves
    three empty)."""
    kernels = load_kernels(isa=isa)
    team = ThreadTeam(kernels, threads)
    monkeypatch.setattr(decode_module, "TEAM_MIN_MLA_WORK", 0)  # these rows are too little work for a team
    monkeypatch.setattr(decode_module, "MIN_SPLIT_KEYS", 1)
    for dtype in (torch.float32, torch.bfloat16):
        for R, P in ((32, 16), (72, 8), (512, 64)):  # a tail in either part; DeepSeek's own widths
            q, latent, k_pe, tables, pos, lo, page_size, scale = _mla_case(dtype, R, R, P)
            out = torch.empty(q.shape[0], q.shape[1], R, dtype=dtype)
            keys = int((pos - lo + 1).sum())
            attention = DecodeAttention(kernels, lambda: team)
            attention.attend(q, latent, latent, tables, pos, lo, page_size, scale, keys, None, out, kr_SHd=k_pe)
            want = _reference(q, torch.cat((latent, k_pe), dim=-1), latent, tables, pos, lo, page_size, scale, None)
            if dtype == torch.float32:
                assert rel_err(out, want) <= 1e-5, (R, P)
            else:
                assert (out.float() - want).abs().max() <= 2 * 2 ** -8 * want.abs().max(), (R, P)
    assert (team.shared_jobs > 0) == (threads > 1)
    team.close()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_keys_merge_to_the_whole_rows_attention_with_sinks_counted_once(dtype, monkeypatch):
    """4 rows of 2 KV heads on 16 threads: each row's keys in 2 ranges whose partial softmaxes are merged."""
    monkeypatch.setattr(decode_module, "TEAM_MIN_KV_BYTES", 0)
    monkeypatch.setattr(decode_module, "MIN_SPLIT_KEYS", 1)
    threads = ThreadTeam(KERNELS, 16)
    _check_attention(KERNELS, lambda: threads, dtype, _case(dtype, sinks=True))
    assert threads.shared_jobs > 0
    threads.close()


def test_mla_rows_go_to_the_kernel_where_it_was_measured_faster():
    bf16, avx2 = ISA_NAMES.index("avx512bf16"), ISA_NAMES.index("avx2")
    assert decode_module.kernel_attends_mla(128, torch.bfloat16, bf16)  # DeepSeek-V3 with pair products
    assert decode_module.kernel_attends_mla(16, torch.bfloat16, avx2)  # DeepSeek-V2-Lite without
    assert not decode_module.kernel_attends_mla(128, torch.bfloat16, avx2)
    assert not decode_module.kernel_attends_mla(16, torch.float32, bf16)  # torch's fp32 matmuls are faster


def test_a_team_splits_keys_only_where_rows_and_kv_heads_leave_threads_idle():
    split = decode_module.key_splits
    assert split(rows=8, kv_heads=4, threads=16, keys=8 * 4096) == 1  # 32 tasks already
    assert split(rows=1, kv_heads=1, threads=16, keys=16384) == 16  # one long MLA row: 16 ranges of 1,024
    assert split(rows=1, kv_heads=4, threads=16, keys=16384) == 4  # Qwen3's 4 KV heads: 4 ranges each
    assert split(rows=1, kv_heads=1, threads=16, keys=1024) == 1024 // decode_module.MIN_SPLIT_KEYS  # short row
    assert split(rows=2, kv_heads=1, threads=8, keys=100) == 1  # too short to split


def _check_attention(kernels, team, dtype, case) -> None:
    q, k, v, tables, pos, lo, page_size, scale, sinks_H = case
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=dtype)
    keys = int((pos - lo + 1).sum())
    DecodeAttention(kernels, team).attend(q, k, v, tables, pos, lo, page_size, scale, keys, sinks_H, out)
    want = _reference(q, k, v, tables, pos, lo, page_size, scale, sinks_H)
    if dtype == torch.float32:
        assert rel_err(out, want) <= 1e-5
    else:
        assert (out.float() - want).abs().max() <= 2 * 2 ** -8 * want.abs().max()


@needs_kernels
@pytest.mark.parametrize("arch, dtype", [("qwen3_moe", torch.float32), ("deepseek_v2", torch.bfloat16)])
def test_a_decode_step_reads_the_past_where_it_lies(arch, dtype, tiny_dir):
    """No gather of past K/V in a decode step (index_select was one per layer per K and V: for MLA, per latent
    and roped key; the kernel takes MLA rows in bf16), and the greedy tokens equal those of the gathered path."""
    got = {}
    for in_place in (True, False):
        with LLM(tiny_dir(arch), dtype=dtype, page_size=4, progress=False) as llm:
            if not in_place:
                llm.engine.decode_attention = None
            engine = llm.engine
            seq = engine.add(list(range(3, 20)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            for _ in range(3):
                engine.step()
            ops = OpCounter()
            with ops:
                engine.step()
            engine.run_to_completion()
            got[in_place] = (seq.output_ids, ops.names["index_select"])
    assert got[True][0] == got[False][0]
    assert got[True][1] == 0 < got[False][1]


@needs_kernels
def test_a_prompt_chunk_after_a_past_reads_it_where_it_lies_but_for_mla(tiny_dir):
    """A prompt's second chunk beside a decode row gathers no past K/V where the kernel reads chunks (MLA's
    chunks keep the gathered path, one index_select per layer per latent and roped key), and the next tokens equal
    those of the gathered path."""
    for arch, gathered in (("qwen3_moe", False), ("deepseek_v2", True)):
        got = {}
        for in_place in (True, False):
            with LLM(tiny_dir(arch), dtype=torch.bfloat16, page_size=4, progress=False) as llm:
                engine = llm.engine
                if not in_place:
                    engine.decode_attention = None
                first, second = engine.new_sequence(), engine.new_sequence()
                engine.feed([first, second], [list(range(3, 12)), list(range(20, 31))])
                ops = OpCounter()
                with ops:
                    rows = engine.feed([first, second], [[5], list(range(40, 47))])
                got[in_place] = ([int(r[-1].float().argmax()) for r in rows], ops.names["index_select"])
        assert got[True][0] == got[False][0], arch
        assert (got[True][1] > 0) == gathered and got[False][1] > 0, arch


@needs_kernels
@pytest.mark.parametrize("window, sinks", [(None, False), (6, True)])
def test_prompt_chunks_attend_their_pages_in_place_row_by_row_causally_and_within_the_window(window, sinks):
    """Two chunks of one step after a decode row (20 rows after a past of 10; 5 rows of a new sequence): each
    chunk row against its own keys, up to its own position, in the window; the decode row's output untouched."""
    g = torch.Generator().manual_seed(1)
    page_size, H, Hkv, d = 4, 6, 2, 16
    pages = (torch.randperm(60, generator=g)[:9] + 1).tolist()
    feeds = [SeqFeed(7, 1, {window: [63, 64]}), SeqFeed(10, 20, {window: pages[:8]}),
             SeqFeed(0, 5, {window: [61, 62]})]
    step = RaggedStep(feeds, page_size, {0: window}, torch.device("cpu"), torch.float32,
                      decode_attention=DecodeAttention(KERNELS, lambda: None))
    assert step.chunk_attention is not None and step.first_gathered == len(step.row_parts) and not step.decode_only
    k, v = torch.randn(65 * page_size, Hkv, d, generator=g), torch.randn(65 * page_size, Hkv, d, generator=g)
    q, out = torch.randn(26, H, d, generator=g), torch.zeros(26, H, d)
    sinks_H = torch.randn(H, generator=g) if sinks else None
    step.chunk_attention.attend_chunks(step, window, q, k, v, 0.25, sinks_H, out)
    pos = torch.tensor([10 + i for i in range(20)] + list(range(5)), dtype=torch.int32)
    lo = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0)
    tables = torch.tensor([pages[:8]] * 20 + [[61, 62] + [0] * 6] * 5)
    assert rel_err(out[1:], _reference(q[1:], k, v, tables, pos, lo, page_size, 0.25, sinks_H)) <= 1e-5
    assert not out[0].any()  # the decode row is attend_decode_rows' (RaggedStep.attend_in_place calls both)
    fp32 = DecodeAttention(KERNELS, lambda: None, max_chunk_rows=20)  # fp32's bound: a longer chunk is gathered
    assert RaggedStep(feeds, page_size, {0: window}, torch.device("cpu"), torch.float32,
                      decode_attention=fp32).chunk_attention is not None
    longer = [feeds[0], SeqFeed(10, 21, {window: pages[:8]})]
    assert RaggedStep(longer, page_size, {0: window}, torch.device("cpu"), torch.float32,
                      decode_attention=fp32).chunk_attention is None


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_equals_transformers_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    T, H, d = 5, 3, 16
    x = torch.randn(T, 2 * H, d, generator=g).to(dtype)[:, ::2]  # strided heads, as a split of one projection
    angles = torch.randn(T, d // 2, generator=g) * 3
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    DecodeAttention(KERNELS, lambda: None).rotate(x, cos, sin)
    assert torch.equal(x, want[0].transpose(0, 1))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_equals_gpt_oss_half_width_form_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 8, generator=g).to(dtype)
    angles = torch.randn(4, 4, generator=g) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want, _ = gpt_oss_rotary(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    DecodeAttention(KERNELS, lambda: None).rotate(x, cos, sin, half_width=True)
    assert torch.equal(x, want[0].transpose(0, 1))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_equals_glms_partial_rotary_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 16, generator=g).to(dtype)[:, 1::2]  # strided heads
    angles = torch.randn(4, 4, generator=g) * 3  # tables of 8 values: each head's first 8 turned, the rest kept
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    want, _ = glm_rotary(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    DecodeAttention(KERNELS, lambda: None).rotate(x, cos, sin)
    assert torch.equal(x, want[0].transpose(0, 1))


@needs_kernels
def test_in_place_decode_is_used_only_where_the_kernel_computes_it(tiny_dir):
    """fp32 / bf16 standard attention on the CPU: yes; fp16 (the kernel reads fp32 or bf16): no. MLA where the
    kernel is faster than torch: bf16, and more than MLA_KERNEL_MAX_HEADS heads only with AVX512-BF16."""
    for arch, dtype, expected in (("qwen3_moe", torch.bfloat16, True), ("qwen3_moe", torch.float16, False),
                                  ("deepseek_v3", torch.bfloat16, True), ("deepseek_v3", torch.float32, False)):
        with LLM(tiny_dir(arch), dtype=dtype, progress=False) as llm:
            assert (llm.hybrid.decode_attention is not None) == expected, (arch, dtype)
    path = tiny_dir("deepseek_v2")
    pair_products = KERNELS.isa >= ISA_NAMES.index("avx512bf16")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_module, "MLA_KERNEL_MAX_HEADS", load_config(path).num_attention_heads - 1)
        with LLM(path, dtype=torch.bfloat16, progress=False) as llm:
            assert (llm.hybrid.decode_attention is not None) == pair_products
