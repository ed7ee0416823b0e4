"""Decode rows attending the KV pool where it lies, on the CPU, in one native call per layer.

A decode row is one query token after its sequence's past. Through transformers' attention functions each run
of decode rows costs a gather of its pages out of the pool (a copy of every past K/V it reads), a padded mask,
per-part views and an SDPA call: about 40 dispatched ops per layer and the copy, for a few microseconds of
arithmetic. `tm_paged_decode_attention` (tiermoe/experts/csrc/paged_attention.cpp) reads each row's keys through
its page table instead: no copy, no padding, no mask. A prompt chunk's rows are read the same way, each row a
query at its own position (`attend_chunks`, RaggedStep.chunk_rows): reading a chunk's keys once per row costs less
than gathering them and repeating each KV head for its query heads, as transformers' SDPA path does, for every
bf16 chunk measured (benchmarks/bench_chunk_attention.py, Qwen3-30B-A3B's 32 / 4 heads, one thread of a 2-core AMD
EPYC: 7.4x at 8 rows after a 4k past, 4.2x at 16, 1.5x at 128, 2.1x for 512 rows at the start, 1.2x for 512 after
2k). In fp32 torch's matmuls win for many rows after a long past (0.72-0.78x in place for 128 and 512 rows after 2-4k
keys), so fp32 chunks of more than FP32_MAX_CHUNK_ROWS rows are gathered. MLA's prompt chunks keep the gathered path
(its expanded form is the cheaper one for many queries).

Used where the model is on the CPU in fp32 or bf16, the kernels are built, and nothing needs gradients
(`decode_attention_for` decides), by transformers' softmax attentions that the pool serves through
tiermoe.layers.paged_attention and by MLA (tiermoe.layers.mla_attention), whose absorbed decode is attention of
every head over one shared key [latent | roped key] and value (the latent): a two-part key, read where both
parts lie. Results equal SDPA's within fp32 rounding (scores summed in another order); bf16 rows are computed
in fp32 and rounded once, but for their probabilities, which are rounded to bf16 before the product with V where
the ISA sums values in bf16 pairs (AVX512-BF16), as torch's bf16 attention rounds them.
The same object runs the decode step of Qwen3-Next's linear attention, the gated delta rule, on states kept in
the pool's slots (`gated_delta`, csrc/gated_delta.cpp; tiermoe.layers.gated_delta_decode uses it): each state
read where it lies and written once, not gathered, updated in a dozen torch passes and scattered back.
Legend: T decode rows, H query heads, Hkv KV heads, d head dim, dv value dim, S pool slots.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from tiermoe.errors import TiermoeError
from tiermoe.experts.kernels import (
    ISA_NAMES,
    SOLO_BYTES,
    Kernels,
    ThreadTeam,
    TmAttnArgs,
    TmDeltaArgs,
)
from tiermoe.layers import triton_paged_attention
from tiermoe.layers.mla_attention import MLAAttention
from tiermoe.layers.triton_paged_attention import TritonPagedAttention

log = logging.getLogger(__name__)

# Multiply-adds below which the calling thread runs the gated delta rule alone: waking the team costs more than it
# saves.
TEAM_MIN_WORK = 1 << 20
# K/V bytes below which the calling thread attends alone, as the kernels' products run alone below SOLO_BYTES of
# weights: waking a sleeping helper costs ~250 us on this project's 2-vCPU VMs. A lower threshold helps one case
# and hurts another (BENCHMARKS.md, "Sharing smaller attentions"): at 1 MB the demo model's 8-row step (2.8 MB of
# K/V a layer) decodes 20-25% faster, but a Qwen3-30B-A3B-shaped row alone at a 1k past (2 MB a layer) about 10%
# slower.
TEAM_MIN_KV_BYTES = SOLO_BYTES
# Multiply-adds beyond which a team attends absorbed MLA rows however few bytes they read: all of a row's heads (16
# to 128) read one latent, so its arithmetic, not its reads, is the cost (a GQA row's heads read their own KV
# heads: the bytes decide there).
TEAM_MIN_MLA_WORK = 16 << 20
# Where the kernel attends MLA decode rows faster than torch on their gathered latent (one thread,
# benchmarks/bench_decode_attention.py; torch's time leaves out the gather it needs). bf16 with AVX512-BF16, whose
# pair products sum the values two keys at a time for groups of heads: 4.1-6.1x at DeepSeek-V2-Lite's 16 heads,
# 1.3-1.6x at DeepSeek-V3's 128 (and no past copied). bf16 without them: 1.3-1.9x at 16 heads, 0.8-1.1x at 32,
# 0.4-0.7x beyond.
# fp32: 0.5-0.8x at every head count (torch's fp32 matmuls), so fp32 MLA rows are gathered. The kernel's arithmetic
# grows with the heads, while torch's batched matmuls reuse each latent row across them.
MLA_KERNEL_MAX_HEADS = 32  # without pair products
# Keys a split of a row takes at least: below it the merge and the wake of another thread cost more than they save.
MIN_SPLIT_KEYS = 256
# fp32 prompt chunks read in place up to this many rows (the module docstring; 1.1-1.7x at 64 rows after 1-4k keys)
FP32_MAX_CHUNK_ROWS = 64
DELTA_MAX_HEAD_DIM = 512  # csrc/tm_kernels.h TM_DELTA_MAX_DIM: the native rule refuses larger head dims
_DTYPES = (torch.float32, torch.bfloat16)


class DecodeAttention:
    """The native decode attention on `kernels`; `team` gives the model's kernel thread team."""

    def __init__(self, kernels: Kernels, team: Callable[[], ThreadTeam], reads_chunks: bool = True,
                 max_chunk_rows: int | None = None):
        self.kernels, self.team = kernels, team
        self.reads_chunks = reads_chunks  # whether prompt chunks attend in place too (RaggedStep.chunk_attention)
        self.max_chunk_rows = max_chunk_rows  # a step with a longer chunk gathers its chunks (None: any length)

    def attend(self, q_THd: torch.Tensor, k_SHd: torch.Tensor, v_SHd: torch.Tensor, tables_TN: torch.Tensor,
               pos_T: torch.Tensor, lo_T: torch.Tensor, page_size: int, scale: float, keys: int,
               sinks_H: torch.Tensor | None, out_THd: torch.Tensor, kr_SHd: torch.Tensor | None = None) -> None:
        """Fill out [T, H, dv] (contiguous) with each row's attention over key positions [lo, pos] of its pages.

        q [T, H, d (+ dr)] may be strided (head dims contiguous); K/V slots [S, Hkv, d | dv] are the pool's;
        kr [S, Hkv, dr]: a key's second part, where a key is [K slot | KR slot] (absorbed MLA: the latent and
        the roped key; its V slots are the K slots themselves); tables [T, N] int64 page ids; pos, lo [T] int32;
        keys: the rows' visible keys in total (sizes the work)."""
        T, H, dq = q_THd.shape
        Hkv, d, dv = k_SHd.shape[1], k_SHd.shape[2], v_SHd.shape[2]
        dr = 0 if kr_SHd is None else kr_SHd.shape[2]
        if any(x.dtype != q_THd.dtype for x in (k_SHd, v_SHd, out_THd) + (() if kr_SHd is None else (kr_SHd,))):
            raise ValueError(f"decode attention needs one dtype, got q {q_THd.dtype}, K {k_SHd.dtype}, "
                             f"V {v_SHd.dtype}, out {out_THd.dtype}")
        if dq != d + dr or (kr_SHd is not None and kr_SHd.shape[:2] != k_SHd.shape[:2]):
            raise ValueError(f"decode attention's query has {dq} values a head, its keys {d} + {dr}")
        sinks = None if sinks_H is None else sinks_H.detach().float().contiguous()
        team, splits = self.plan(T, H, Hkv, d, dr, dv, keys, v_SHd.data_ptr() == k_SHd.data_ptr(),
                                 k_SHd.element_size())
        args = TmAttnArgs(isa=self.kernels.isa, T=T, H=H, Hkv=Hkv, d=d, dv=dv, dr=dr, page_size=page_size,
                          max_pages=tables_TN.shape[1], x_bf16=int(q_THd.dtype == torch.bfloat16),
                          q_row_stride=q_THd.stride(0), q_head_stride=q_THd.stride(1), scale=scale,
                          key_splits=splits, q=q_THd.data_ptr(),
                          k_slots=k_SHd.data_ptr(), kr_slots=None if kr_SHd is None else kr_SHd.data_ptr(),
                          v_slots=v_SHd.data_ptr(), sinks=None if sinks is None else sinks.data_ptr(),
                          tables=tables_TN.data_ptr(), pos=pos_T.data_ptr(), lo=lo_T.data_ptr(),
                          out=out_THd.data_ptr())
        err = ctypes.create_string_buffer(256)
        if self.kernels.lib.tm_paged_decode_attention(None if team is None else team.handle, ctypes.byref(args),
                                                      err, len(err)) != 0:
            raise RuntimeError(err.value.decode())

    def plan(self, T: int, H: int, Hkv: int, d: int, dr: int, dv: int, keys: int, values_are_keys: bool,
             itemsize: int):
        """(the team, or None for the calling thread alone; key splits) of an `attend` call of these sizes: the team
        where the keys read (or MLA's multiply-adds: `dr` > 0) are worth its wake-up."""
        kv_bytes = keys * Hkv * (d + dr + (0 if values_are_keys else dv)) * itemsize
        mla_work = keys * H * (d + dr + dv) if dr else 0
        if kv_bytes < TEAM_MIN_KV_BYTES and mla_work < TEAM_MIN_MLA_WORK:
            return None, 1
        team = self.team()
        return team, key_splits(T, Hkv, team.n, keys)

    def attend_chunks(self, step, window: int | None, q_THd: torch.Tensor, k_SHd: torch.Tensor, v_SHd: torch.Tensor,
                      scale: float, sinks_H: torch.Tensor | None, out_THd: torch.Tensor) -> None:
        """The prompt chunks' rows of `step` (its rows from num_decode on) attending their sequences' pages in place,
        each at its own position (causal within its chunk): q [T, H, d] and out [T, H, dv] are the whole step's
        rows, as TritonPagedAttention.attend_chunks takes them."""
        index, pos = step.chunk_rows(window)
        n = step.num_decode
        self.attend(q_THd[n:], k_SHd, v_SHd, index.tables, pos, index.lo, step.page_size, scale, index.keys, sinks_H,
                    out_THd[n:])

    def takes_gated_delta(self, qkv: torch.Tensor, states: torch.Tensor) -> bool:
        """Whether `gated_delta` computes these rows: CPU tensors, rows in fp32 / bf16, fp32 states, no gradient."""
        return (qkv.device.type == "cpu" and qkv.dtype in _DTYPES and states.dtype == torch.float32
                and states.is_contiguous() and max(states.shape[-2:]) <= DELTA_MAX_HEAD_DIM and not qkv.requires_grad)

    def gated_delta(self, qkv_bC: torch.Tensor, key_heads: int, head_k_dim: int, g_bH: torch.Tensor,
                    beta_bH: torch.Tensor, states_SHkv: torch.Tensor, read_b: torch.Tensor, write_b: torch.Tensor,
                    out_bHv: torch.Tensor) -> None:
        """One token of a gated delta rule per row (csrc/gated_delta.cpp): each row's state [Hv, dk, dv] read from
        slot read[b] of `states` and its update written to slot write[b]; its output into out [b, Hv, dv].

        qkv [b, C]: the row's q [Hk, dk], k [Hk, dk], v [Hv, dv] after the conv; g [b, Hv] log decays (fp32);
        beta [b, Hv] in qkv's dtype; states fp32 contiguous; read / write [b] int64."""
        b, Hv, dv = out_bHv.shape
        qkv = qkv_bC.contiguous()
        g, beta = g_bH.float().contiguous(), beta_bH.to(qkv.dtype).contiguous()
        read, write = read_b.contiguous(), write_b.contiguous()
        key_dim = key_heads * head_k_dim
        if qkv.shape[1] != 2 * key_dim + Hv * dv or states_SHkv.shape[1:] != (Hv, head_k_dim, dv):
            raise ValueError(f"gated delta shapes disagree: qkv {tuple(qkv.shape)}, states "
                             f"{tuple(states_SHkv.shape)}, {key_heads} key heads of {head_k_dim}, out {tuple(out_bHv.shape)}")
        args = TmDeltaArgs(isa=self.kernels.isa, B=b, Hk=key_heads, Hv=Hv, dk=head_k_dim, dv=dv,
                           x_bf16=int(qkv.dtype == torch.bfloat16), qkv_row_stride=qkv.stride(0), q_offset=0,
                           k_offset=key_dim, v_offset=2 * key_dim, qkv=qkv.data_ptr(), g=g.data_ptr(),
                           beta=beta.data_ptr(), state=states_SHkv.data_ptr(), read=read.data_ptr(),
                           write=write.data_ptr(), out=out_bHv.data_ptr())
        team = self.team().handle if b * Hv * head_k_dim * dv >= TEAM_MIN_WORK else None
        err = ctypes.create_string_buffer(256)
        if self.kernels.lib.tm_gated_delta_decode(team, ctypes.byref(args), err, len(err)) != 0:
            raise RuntimeError(err.value.decode())

    def rotate(self, x_THd: torch.Tensor, cos_Tr: torch.Tensor, sin_Tr: torch.Tensor, half_width: bool = False) -> None:
        """transformers' rotary embedding (x * cos + rotate_half(x) * sin, with its roundings) applied to x [T, H, d]
        in place (head values contiguous), cos / sin [T, r] in x's dtype: over each head's first r values (r = d; r
        < d: partial rotary, GLM-4.5's, the rest passed through), or, `half_width` (GPT-OSS), over the whole head
        with r = d / 2 values for both halves."""
        T, H, d = x_THd.shape
        r = cos_Tr.shape[-1]
        if (x_THd.stride(-1) != 1 or cos_Tr.stride(-1) != 1 or sin_Tr.stride(-1) != 1 or cos_Tr.dtype != x_THd.dtype
                or (r != d // 2 if half_width else r > d)):
            raise ValueError("rotary embedding needs contiguous head values and cos / sin in the tensor's dtype, of "
                             "at most the head dim (half of it for the half-width form)")
        if self.kernels.lib.tm_rotary_inplace(x_THd.data_ptr(), T, H, d if half_width else r, x_THd.stride(0),
                                              x_THd.stride(1), cos_Tr.data_ptr(), sin_Tr.data_ptr(), cos_Tr.stride(0),
                                              int(half_width), int(x_THd.dtype == torch.bfloat16)) != 0:
            raise ValueError(f"rotary embedding needs an even width, got {d if half_width else r}")


def key_splits(rows: int, kv_heads: int, threads: int, keys: int) -> int:
    """Ranges each row's keys are split into for a team (csrc/paged_attention.cpp: partial softmaxes, merged): one
    where the rows and KV heads are tasks enough for the threads; else as many as the idle threads need, each of
    at least MIN_SPLIT_KEYS keys of an average row (`keys`: the rows' visible keys in total)."""
    tasks = rows * kv_heads
    if tasks >= threads:
        return 1
    return max(1, min(-(-threads // tasks), keys // rows // MIN_SPLIT_KEYS))


ATTENTION_BACKENDS = ("auto", "native", "triton", "torch")
# SGLang's names (`--attention-backend` on a KTransformers launch line): its torch path is ours; the kernels tiermoe
# does not build leave the choice to "auto", said once in the log.
SGLANG_ALIASES = {"torch_native": "torch"}
SGLANG_ONLY = ("flashinfer", "fa3", "fa4", "flashmla", "cutlass_mla", "trtllm_mla", "trtllm_mha", "aiter", "wave",
               "flex_attention", "dual_chunk_flash_attn", "intel_amx", "ascend")


def check_attention_backend(backend: str) -> None:
    if backend not in (*ATTENTION_BACKENDS, *SGLANG_ALIASES, *SGLANG_ONLY):
        raise TiermoeError(f"attention backend '{backend}' is unknown; choose one of: {', '.join(ATTENTION_BACKENDS)}"
                           f" (SGLang's names are taken too)")


def decode_attention_for(model: nn.Module, device: torch.device, kernels: Kernels | None,
                         team: Callable[[], ThreadTeam], trainable: bool,
                         backend: str = "auto") -> DecodeAttention | TritonPagedAttention | None:
    """What the decode rows of `model` on `device` attend the pool in place with, or None where they are gathered
    (transformers' attention function over the pages each step reads). `backend` (`--attention-backend`):
    - "auto": on the CPU the native kernel where it applies (kernels built, fp32 / bf16, no training, MLA only
      where `kernel_attends_mla`); on CUDA the Triton kernel (tiermoe.layers.triton_paged_attention) when triton
      is installed;
    - "native": the native kernel where it applies (else gathered); "triton": the Triton kernel (on a CPU device
      only under Triton's interpreter, TRITON_INTERPRET=1: how the suite checks the CUDA path; without it, as
      "auto"); "torch" (SGLang's "torch_native"): always gathered; SGLang's other kernels: as "auto"."""
    check_attention_backend(backend)
    backend = SGLANG_ALIASES.get(backend, backend)
    if backend in SGLANG_ONLY:
        log.info("attention: SGLang's '%s' backend is not built into tiermoe; choosing as 'auto' does", backend)
        backend = "auto"
    on_cpu = torch.device(device).type == "cpu"
    if trainable or backend == "torch":
        return None
    if backend == "triton" and on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        log.info("attention: the Triton kernel runs on a CUDA device (on the CPU only under TRITON_INTERPRET=1, to "
                 "check the CUDA path); choosing as 'auto' does")
        backend = "auto"
    if backend == "triton" or (backend == "auto" and not on_cpu):
        if not triton_paged_attention.available():
            if backend == "triton":
                raise TiermoeError("--attention-backend triton needs the triton package (pip install triton)")
            log.info("attention: no triton package, so decode rows gather their past from the KV pool each step")
            return None
        mla = any(isinstance(m, MLAAttention) for m in model.modules())
        log.info("attention: decode rows%s read the KV pool in place (Triton kernel); %sQwen3-Next's "
                 "linear-attention states keep the gathered path", "" if mla else " and prompt chunks",
                 "MLA's prompt chunks and " if mla else "")
        return TritonPagedAttention(reads_chunks=not mla)
    if kernels is None or not on_cpu or model.dtype not in _DTYPES:
        return None
    mla_heads = max((m.num_heads for m in model.modules() if isinstance(m, MLAAttention)), default=0)
    if mla_heads and not kernel_attends_mla(mla_heads, model.dtype, kernels.isa):
        return None
    return DecodeAttention(kernels, team, reads_chunks=not mla_heads,
                           max_chunk_rows=None if model.dtype == torch.bfloat16 else FP32_MAX_CHUNK_ROWS)


def kernel_attends_mla(heads: int, dtype: torch.dtype, isa: int) -> bool:
    """Whether the kernel attends MLA decode rows of `heads` heads faster than torch (measured: see
    MLA_KERNEL_MAX_HEADS): bf16 rows, and either the ISA's bf16 pair products or few heads."""
    return dtype == torch.bfloat16 and (isa >= ISA_NAMES.index("avx512bf16") or heads <= MLA_KERNEL_MAX_HEADS)
