"""Attention that reads the paged KV pool where it lies, in Triton: CUDA's decode rows and prompt chunks, no past
gathered.

Without it a CUDA step gathers every row's past K/V out of the pool for every layer (a copy of O(context) bytes per
token and layer) and builds padded masks whose shapes change every step. Here each query reads its keys through
its sequence's page table, as the CPU's native kernel (tiermoe.layers.decode_attention) does for decode rows, with
the metadata in the step buffers (tiermoe.layers.step_buffers: fixed addresses), an online softmax in fp32, and
each key's slot = table[key // P] * P + key % P:
- decode rows (`attend`, fed a step's by RaggedStep.attend_decode_rows): one program per (row, KV head, BLOCK_H
  of its query heads), over the row's visible keys [lo, pos] (the step's decode tables, lo and pos); each key
  block is read once for all the program's heads;
- prompt chunks (`attend_chunks`): a chunk's rows are cut into blocks of CHUNK_ROWS consecutive queries
  (RaggedStep.chunk_blocks); one program per (block, KV head, CHUNK_HEADS of its query heads) walks the keys from
  the block's first visible one to its last query, each query masked causally and to its window.

Kinds covered: grouped-query attention (a query head reads KV head h // (H / Hkv)), sliding windows, attention
sinks (GPT-OSS: one logit per head that joins the softmax's denominator and no value), and MLA's absorbed decode (a
two-part key [latent | roped key] whose first part is also the value; tiermoe.layers.mla_attention). Kept on their
torch path, said once in the log at load: MLA's prompt chunks (they choose per part between the absorbed and the
expanded form) and Qwen3-Next's gated-delta states (`takes_gated_delta` is False).

Products and sums are fp32 whatever the pool's dtype (bf16 K/V are widened as they load, the products take IEEE
precision, not TF32; the output is rounded once), so fp32 rows equal SDPA's within fp32 rounding. The suite runs
it under Triton's interpreter (TRITON_INTERPRET=1) on the CPU. Legend: T rows, H query heads, Hkv KV heads, d key
dim (+ dr, MLA's roped part), dv value dim, S pool slots, W pages in a table.
"""

from __future__ import annotations

import torch

from tiermoe.layers.ragged_step import RaggedStep
from tiermoe.layers.step_buffers import CHUNK_ROWS

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: torch's CUDA builds bring it; without it CUDA decode rows are gathered
    triton = None

BLOCK_N = 32  # keys per iteration of a program
# Query heads per program: the heads of one KV head share each key block they read (a tensor-core product needs
# 16 rows; GQA groups of fewer heads leave the rest masked).
BLOCK_H = 16
# Query heads of one KV head a chunk program takes beside its CHUNK_ROWS rows (64 queries a program at most).
CHUNK_HEADS = 4


def available() -> bool:
    return triton is not None


class TritonPagedAttention:
    """The decode rows' attention over the pool, for RaggedStep's `decode_attention` (same calls as the native
    DecodeAttention's), and with `reads_chunks` the prompt chunks' too (`attend_chunks`; not for MLA, whose
    chunks choose between the absorbed and the expanded form per part: tiermoe.layers.mla_attention)."""

    def __init__(self, reads_chunks: bool = True):
        self.reads_chunks = reads_chunks

    def attend(self, q_THd: torch.Tensor, k_SHd: torch.Tensor, v_SHd: torch.Tensor, tables_TN: torch.Tensor,
               pos_T: torch.Tensor, lo_T: torch.Tensor, page_size: int, scale: float, keys: int,
               sinks_H: torch.Tensor | None, out_THd: torch.Tensor, kr_SHd: torch.Tensor | None = None) -> None:
        """Fill out [T, H, dv] with each row's attention over key positions [lo, pos] of its pages.

        q [T, H, d (+ dr)] (head values contiguous); K/V slots [S, Hkv, d | dv]; kr [S, Hkv, dr]: a key's second
        part (absorbed MLA); tables [T, W] int64 page ids; pos, lo [T] int32; sinks [H] or None. `keys` (the
        rows' visible keys in total) is not needed: every program walks its own row."""
        T, H, dq = q_THd.shape
        Hkv, d, dv = k_SHd.shape[1], k_SHd.shape[2], v_SHd.shape[2]
        dr = 0 if kr_SHd is None else kr_SHd.shape[2]
        if dq != d + dr or H % Hkv:
            raise ValueError(f"paged attention: queries [{T}, {H}, {dq}] do not fit keys of {Hkv} heads of {d} + {dr}")
        if T == 0:
            return
        if q_THd.stride(-1) != 1 or k_SHd.stride(-1) != 1 or v_SHd.stride(-1) != 1 or out_THd.stride(-1) != 1:
            raise ValueError("paged attention needs contiguous head values")
        kr = k_SHd if kr_SHd is None else kr_SHd  # some pointer when there is no second part
        sinks = q_THd if sinks_H is None else sinks_H.detach().contiguous()
        group = H // Hkv
        _paged_attention_kernel[(T, Hkv, -(-group // BLOCK_H))](
            q_THd, k_SHd, kr, v_SHd, sinks, out_THd, tables_TN, pos_T, lo_T, page_size, float(scale),
            q_THd.stride(0), q_THd.stride(1), k_SHd.stride(0), k_SHd.stride(1), kr.stride(0), kr.stride(1),
            v_SHd.stride(0), v_SHd.stride(1), out_THd.stride(0), out_THd.stride(1), tables_TN.stride(0),
            GROUP=group, D=d, DR=dr, DV=dv, BLOCK_H=BLOCK_H, BLOCK_D=triton.next_power_of_2(d),
            BLOCK_DR=triton.next_power_of_2(max(dr, 1)), BLOCK_DV=triton.next_power_of_2(dv), BLOCK_N=BLOCK_N,
            HAS_SINKS=sinks_H is not None)

    def attend_chunks(self, step: RaggedStep, window: int | None, q_THd: torch.Tensor, k_SHd: torch.Tensor,
                      v_SHd: torch.Tensor, scale: float, sinks_H: torch.Tensor | None, out_THd: torch.Tensor) -> None:
        """The prompt chunks' rows of `step` (its rows from num_decode on) attending their sequences' pages in
        place, causally within each chunk: q [T, H, d] and out [T, H, dv] are the whole step's rows."""
        blocks, tables = step.chunk_blocks, step.groups[window].chunk_tables
        H, d = q_THd.shape[1:]
        Hkv, dv = k_SHd.shape[1], v_SHd.shape[2]
        if q_THd.stride(-1) != 1 or k_SHd.stride(-1) != 1 or v_SHd.stride(-1) != 1 or out_THd.stride(-1) != 1:
            raise ValueError("paged attention needs contiguous head values")
        sinks = q_THd if sinks_H is None else sinks_H.detach().contiguous()
        group = H // Hkv
        block_g = min(triton.next_power_of_2(group), CHUNK_HEADS)
        _chunk_kernel[(blocks.shape[0], Hkv, -(-group // block_g))](
            q_THd, k_SHd, v_SHd, sinks, out_THd, tables, blocks, step.page_size, window or 0, float(scale),
            q_THd.stride(0), q_THd.stride(1), k_SHd.stride(0), k_SHd.stride(1), v_SHd.stride(0), v_SHd.stride(1),
            out_THd.stride(0), out_THd.stride(1), tables.stride(0),
            GROUP=group, D=d, DV=dv, BLOCK_M=CHUNK_ROWS, BLOCK_G=block_g, BLOCK_D=triton.next_power_of_2(d),
            BLOCK_DV=triton.next_power_of_2(dv), BLOCK_N=BLOCK_N, HAS_SINKS=sinks_H is not None)

    def takes_gated_delta(self, qkv: torch.Tensor, states: torch.Tensor) -> bool:
        return False  # Qwen3-Next's linear attention keeps transformers' rule on gathered states


if triton is not None:

    @triton.jit
    def _online_softmax(s, v, m_i, l_i, acc):
        """One key block into a running softmax: scores s [M, N] (-inf where a key is not visible), values v [N, DV],
        the rows' running maximum m [M], denominator l [M] and weighted sum acc [M, DV] -> their updates."""
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row none of whose keys came yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")

    @triton.jit
    def _with_sinks(sink, m_i, l_i, acc):
        """The sinks' logits [M] joined to the running softmax's denominator (they add no value) -> (l, acc)."""
        sink = sink.to(tl.float32)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        return l_i * alpha + tl.exp(sink - m_new), acc * alpha[:, None]

    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, kr_ptr, v_ptr, sinks_ptr, out_ptr, tables_ptr, pos_ptr, lo_ptr,
                                page_size, scale, stride_qt, stride_qh, stride_ks, stride_kh, stride_krs, stride_krh,
                                stride_vs, stride_vh, stride_ot, stride_oh, stride_tt,
                                GROUP: tl.constexpr, D: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
                                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr,
                                BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKS: tl.constexpr):
        row, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        g = part * BLOCK_H + tl.arange(0, BLOCK_H)  # the query heads of this KV head that this program takes
        head_ok = g < GROUP
        head = kv_head * GROUP + g
        pos = tl.load(pos_ptr + row).to(tl.int32)
        lo = tl.load(lo_ptr + row).to(tl.int32)
        q_rows = q_ptr + row * stride_qt + head[:, None] * stride_qh
        dk = tl.arange(0, BLOCK_D)
        q = tl.load(q_rows + dk[None, :], mask=head_ok[:, None] & (dk[None, :] < D), other=0.0).to(tl.float32)
        dr = tl.arange(0, BLOCK_DR)
        qr = tl.zeros([BLOCK_H, BLOCK_DR], dtype=tl.float32)
        if DR > 0:
            qr = tl.load(q_rows + D + dr[None, :], mask=head_ok[:, None] & (dr[None, :] < DR),
                         other=0.0).to(tl.float32)
        dv = tl.arange(0, BLOCK_DV)
        m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        for start in range(lo, pos + 1, BLOCK_N):  # the first block holds key lo: m_i is finite after it
            key = start + tl.arange(0, BLOCK_N)
            valid = key <= pos
            page = tl.load(tables_ptr + row * stride_tt + key // page_size, mask=valid, other=0)
            slot = page.to(tl.int64) * page_size + (key % page_size)
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + dk[None, :],
                        mask=valid[:, None] & (dk[None, :] < D), other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
            if DR > 0:
                kr = tl.load(kr_ptr + slot[:, None] * stride_krs + kv_head * stride_krh + dr[None, :],
                             mask=valid[:, None] & (dr[None, :] < DR), other=0.0).to(tl.float32)
                s += tl.dot(qr, tl.trans(kr), input_precision="ieee")
            s = tl.where(valid[None, :], s * scale, -float("inf"))
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
                        mask=valid[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc)
        if HAS_SINKS:
            l_i, acc = _with_sinks(tl.load(sinks_ptr + head, mask=head_ok, other=0.0), m_i, l_i, acc)
        out = acc / l_i[:, None]
        tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (dv[None, :] < DV))


    @triton.jit
    def _chunk_kernel(q_ptr, k_ptr, v_ptr, sinks_ptr, out_ptr, tables_ptr, blocks_ptr, page_size, window, scale,
                      stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
                      stride_tt, GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                      HAS_SINKS: tl.constexpr):
        """One block of a prompt chunk (up to BLOCK_M consecutive query rows of one sequence) for BLOCK_G query heads
        of one KV head: BLOCK_M x BLOCK_G queries (row m, head g) that share every key block they read."""
        block, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row0 = tl.load(blocks_ptr + block * 4)
        rows = tl.load(blocks_ptr + block * 4 + 1)
        chunk = tl.load(blocks_ptr + block * 4 + 2)
        pos0 = tl.load(blocks_ptr + block * 4 + 3)
        r = tl.arange(0, BLOCK_M * BLOCK_G)
        m, g = r // BLOCK_G, part * BLOCK_G + r % BLOCK_G
        query_ok = (m < rows) & (g < GROUP)
        head = kv_head * GROUP + g
        qpos = pos0 + m
        qlo = tl.where(window > 0, tl.maximum(qpos - window + 1, 0), 0)  # each query's first visible key
        dk = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(q_ptr + (row0 + m)[:, None] * stride_qt + head[:, None] * stride_qh + dk[None, :],
                    mask=query_ok[:, None] & (dk[None, :] < D), other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_M * BLOCK_G], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_DV], dtype=tl.float32)
        last = pos0 + rows - 1
        for start in range(tl.where(window > 0, tl.maximum(pos0 - window + 1, 0), 0), last + 1, BLOCK_N):
            key = start + tl.arange(0, BLOCK_N)
            key_ok = key <= last
            page = tl.load(tables_ptr + chunk * stride_tt + key // page_size, mask=key_ok, other=0)
            slot = page.to(tl.int64) * page_size + (key % page_size)
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + dk[None, :],
                        mask=key_ok[:, None] & (dk[None, :] < D), other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            visible = (key[None, :] <= qpos[:, None]) & (key[None, :] >= qlo[:, None]) & query_ok[:, None]
            s = tl.where(visible, s, -float("inf"))
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
                        mask=key_ok[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc)
        if HAS_SINKS:
            l_i, acc = _with_sinks(tl.load(sinks_ptr + head, mask=query_ok, other=0.0), m_i, l_i, acc)
        l_i = tl.where(query_ok, l_i, 1.0)  # queries past the block's end or the group: never stored
        tl.store(out_ptr + (row0 + m)[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=query_ok[:, None] & (dv[None, :] < DV))
