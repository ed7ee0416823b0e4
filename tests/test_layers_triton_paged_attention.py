"""The CUDA path's attention over the KV pool (tiermoe.layers.triton_paged_attention), under Triton's interpreter:
the kernel against a float64 reference for every kind it covers, and a decode step on that path reading the past
where it lies: no op of the step makes bytes that grow with the context (the gathered path copies every past
K/V of every layer, and builds masks as wide)."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.layers import triton_paged_attention
from tiermoe.layers.decode_attention import decode_attention_for
from tiermoe.layers.ragged_step import RaggedStep, SeqFeed
from tiermoe.layers.triton_paged_attention import TritonPagedAttention
from tiermoe.testing.step_bytes import decode_step_bytes

pytestmark = pytest.mark.skipif(not triton_paged_attention.available(), reason="triton is not installed")
PAGE = 4


def reference(q, k, v, tables, pos, lo, scale, sinks=None, kr=None) -> torch.Tensor:
    """Each row over key positions [lo, pos] of its pages, in float64."""
    T, H, _ = q.shape
    group = H // k.shape[1]
    out = torch.empty(T, H, v.shape[2], dtype=torch.float64)
    for t in range(T):
        keys = torch.arange(int(lo[t]), int(pos[t]) + 1)
        slots = tables[t][keys // PAGE] * PAGE + keys % PAGE
        for h in range(H):
            kk = k[slots, h // group].double()
            if kr is not None:
                kk = torch.cat([kk, kr[slots, h // group].double()], -1)
            s = kk @ q[t, h].double() * scale
            if sinks is not None:
                s = torch.cat([s, sinks[h:h + 1].double()])
            out[t, h] = torch.softmax(s, 0)[:len(keys)] @ v[slots, h // group].double()
    return out


@pytest.mark.parametrize("kind", ["gqa", "window_and_sinks", "mla", "wide_group", "bf16"])
def test_the_kernel_equals_attention_over_each_rows_pages(kind):
    g = torch.Generator().manual_seed(0)
    H, Hkv, d, dr, slots = 4, 2, 16, 0, 64
    if kind == "mla":  # one latent head, read as a two-part key whose first part is also the value
        Hkv, d, dr = 1, 24, 8
    if kind == "wide_group":  # more query heads per KV head than one program takes
        H = 40
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    k = torch.randn(slots, Hkv, d, generator=g).to(dtype)
    v = k if kind == "mla" else torch.randn(slots, Hkv, 16, generator=g).to(dtype)
    kr = torch.randn(slots, Hkv, dr, generator=g).to(dtype) if dr else None
    q = torch.randn(5, H, d + dr, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 9, 40, 13], dtype=torch.int32)
    lo = torch.tensor([0, 0, 5, 20, 0] if kind == "window_and_sinks" else [0] * 5, dtype=torch.int32)
    tables = torch.randint(1, slots // PAGE, (5, 11), generator=g)
    sinks = torch.randn(H, generator=g) if kind in ("window_and_sinks", "wide_group") else None
    out = torch.empty(5, H, v.shape[2], dtype=dtype)
    TritonPagedAttention().attend(q, k, v, tables, pos, lo, PAGE, 0.3, 0, sinks, out, kr)
    want = reference(q, k, v, tables, pos, lo, 0.3, sinks, kr)
    if dtype == torch.float32:
        assert rel_err(out.double(), want) <= 1e-5
    else:  # fp32 inside, rounded once (the interpreter's cast to bf16 truncates: 2^-7, where a GPU's rounds: 2^-8)
        assert (out.double() - want).abs().max() <= 2 ** -7 * want.abs().max()


@pytest.mark.parametrize("window, sinks", [(None, False), (6, True)])
def test_prompt_chunks_attend_their_pages_in_place_causally_and_within_the_window(window, sinks):
    """Two chunks of one step (20 rows after a past of 10: two blocks; 5 rows of a new sequence), every query
    against its own keys; 12 query heads on 2 KV heads: more than one program takes."""
    g = torch.Generator().manual_seed(1)
    H, Hkv, d, slots = 12, 2, 16, 256
    feeds = [SeqFeed(10, 20, {window: (torch.randperm(60, generator=g)[:8] + 1).tolist()}),
             SeqFeed(0, 5, {window: [61, 62]})]
    step = RaggedStep(feeds, PAGE, {0: window}, torch.device("cpu"), torch.float32, num_decode=0,
                      decode_attention=TritonPagedAttention())
    assert step.chunk_attention is not None and step.first_gathered == len(step.row_parts)
    k, v = torch.randn(slots, Hkv, d, generator=g), torch.randn(slots, Hkv, d, generator=g)
    q, out = torch.randn(25, H, d, generator=g), torch.empty(25, H, d)
    sinks_H = torch.randn(H, generator=g) if sinks else None
    step.chunk_attention.attend_chunks(step, window, q, k, v, 0.25, sinks_H, out)
    pos = torch.tensor([10 + i for i in range(20)] + list(range(5)), dtype=torch.int32)
    lo = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0)
    tables = torch.stack([torch.tensor(feeds[0].pages[window])] * 20 + [torch.tensor(feeds[1].pages[window] +
                                                                                     [0] * 6)] * 5)
    assert rel_err(out.double(), reference(q, k, v, tables, pos, lo, 0.25, sinks_H)) <= 1e-5


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_decode_step_on_the_cuda_path_makes_no_bytes_that_grow_with_the_past(tiny_dir, backend):
    """"triton": what CUDA runs; "torch": the gathered path it replaces, whose bytes grow (the check can fail)."""
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, page_size=PAGE, max_total_tokens=512, progress=False,
             attention_backend=backend) as llm:
        (short, _), (long, _) = decode_step_bytes(llm, 10), decode_step_bytes(llm, 74)  # same offset in a page
    if backend == "triton":
        assert long == short
    else:
        assert long > short + 2 * 64 * 4 * 8  # at least K and V of the extra past, one layer, 8 floats a key


def test_an_unknown_attention_backend_is_one_clear_error(tiny_dir):
    with pytest.raises(TiermoeError, match="attention backend 'flash' is unknown; choose one of: auto, native"):
        LLM(tiny_dir("qwen3_moe"), attention_backend="flash", progress=False)


def test_triton_on_a_cpu_without_the_interpreter_and_sglangs_other_kernels_choose_as_auto(monkeypatch):
    """A KTransformers launch line's `--attention-backend triton` (or flashinfer) on a CPU serves; torch_native is
    the gathered path."""
    model = torch.nn.Linear(1, 1)
    assert isinstance(decode_attention_for(model, torch.device("cpu"), None, lambda: None, False, "triton"),
                      TritonPagedAttention)  # the suite runs under the interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    for name in ("triton", "flashinfer", "auto"):  # no kernels here: auto has nothing in place on the CPU
        assert decode_attention_for(model, torch.device("cpu"), None, lambda: None, False, name) is None
    assert decode_attention_for(model, torch.device("cpu"), None, lambda: None, False, "torch_native") is None


def test_the_cuda_paths_step_metadata_lies_in_the_step_buffers(tiny_dir):
    """Every tensor the in-place attention reads besides the pool (decode tables, first keys, query positions;
    chunk tables and blocks) is written into the pool's step buffers: the same addresses every step."""
    with LLM(tiny_dir("gpt_oss"), dtype=torch.float32, page_size=PAGE, max_total_tokens=512, progress=False,
             attention_backend="triton") as llm:
        engine, steps = llm.engine, []
        build = engine.pool.step
        engine.pool.step = lambda *args, **kwargs: steps.append(build(*args, **kwargs)) or steps[-1]
        first = engine.add(list(range(3, 20)), SamplingParams(max_tokens=3, ignore_eos=True))
        engine.step()
        engine.add(list(range(5, 14)), SamplingParams(max_tokens=2, ignore_eos=True))  # a chunk beside a decode row
        engine.run_to_completion()
    assert first.output_ids and any(s.num_decode and s.chunk_attention for s in steps)
    buffers = engine.pool.step_buffers
    for step in steps:
        metadata = [step.decode_pos, step.chunk_blocks]
        for group in step.groups.values():
            metadata += [group.chunk_tables] + ([group.decode.tables, group.decode.lo] if group.decode else [])
        assert all(buffers.holds(t) for t in metadata if t is not None)
