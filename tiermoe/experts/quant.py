"""Expert weight formats of the CPU tier: quantise once at load, pack for the kernels, and give weights back.

A matrix W [N, K] (N outputs, K inputs; gate_up is [2I, D], down [D, I]) is stored in one of three formats:
  bf16  w as bf16.                                                                   2 bytes / param
  int8  per output row, symmetric: w = scale[n] * q, q in [-127, 127].              1 byte / param + 4 per row
  int4  groups of 32 along K, asymmetric with an integer zero point:
        w = scale[n] * gscale[n, g] * (q - zero[n, g]), q and zero 4-bit, gscale 8-bit (1..255) relative to the
        row's fp32 scale. 4 + 4/32 + 8/32 = 4.375 bits = 0.547 bytes / param + 4 per row.

Why these: int8 per row keeps every dequantised weight exact in bf16, so AMX can multiply it; int4 with groups of
32 is the smallest group that fits 0.56 bytes / param, and an integer zero point plus a least-squares refit of
each group's scale and offset lowers the error of plain min/max rounding by about 10 %.

Two layouts. "rows" is W's own row order (K padded to 64 for int4 so groups pair up in bytes): what the pure-torch
path computes with and what `dequantize` reads. "blocked" is what the C++ kernels read (csrc/tm_kernels.h): rows
in strips of 16 and consecutive k pairs interleaved, [N/16][K/2][16][2], which is also the AMX B-tile layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tiermoe.experts.kernels import native_library

FORMATS = ("bf16", "int8", "int4")
FORMAT_CODES = {"bf16": 0, "int8": 1, "int4": 2}
INT4_GROUP = 32


def k_align(fmt: str) -> int:
    """Columns (K) a packed matrix is padded to: AMX tiles take 32 k; int4 stores two groups of 32 per zero byte."""
    return 64 if fmt == "int4" else 32


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class QMatrix:
    """One stored matrix. `n`, `k` are W's true shape; padded rows / columns hold zeros."""

    fmt: str
    layout: str  # "rows" | "blocked"
    n: int
    k: int
    codes: torch.Tensor  # bf16 / int8 / uint8 (int4: two codes per byte, low nibble = even k)
    scale: torch.Tensor | None = None  # fp32 [Np]: int8 channel scale, int4 row scale
    gscale: torch.Tensor | None = None  # uint8 int4 group scales
    gzero: torch.Tensor | None = None  # uint8 int4 zero points, two groups per byte (low nibble = even group)
    # blocked only: segments of rows [a, b) of W, each placed at the start of its own block of segment_rows rows
    segments: tuple[tuple[int, int], ...] = ()
    segment_rows: int = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.gscale, self.gzero) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def quantize(w_NK: torch.Tensor, fmt: str) -> QMatrix:
    """W [N, K] (any float dtype) -> a QMatrix in the "rows" layout."""
    n, k = w_NK.shape
    if fmt == "bf16":
        return QMatrix("bf16", "rows", n, k, w_NK.to(torch.bfloat16).contiguous())
    w = w_NK.to(torch.float32)
    if fmt == "int8":
        scale = w.abs().amax(dim=1) / 127.0
        q = torch.round(w / scale.clamp_min(1e-30)[:, None]).clamp_(-127, 127).to(torch.int8)
        return QMatrix("int8", "rows", n, k, q, scale.contiguous())
    if fmt == "int4":
        return _quantize_int4(w)
    raise ValueError(f"unknown expert weight format '{fmt}'; choose one of: {', '.join(FORMATS)}")


def _quantize_int4(w: torch.Tensor, refits: int = 2, native: bool = True) -> QMatrix:
    """Groups of 32: start from each group's min/max, refit scale and offset by least squares a few times (keeping
    each group's best), then store the scale as 8 bits of the row's largest and re-round the codes to it.

    Per-group sums (of q, q^2, q*w) give both the fit and the squared error, so each refit costs one rounding
    pass and three reductions over the weights. The kernel library has the same algorithm fused per group (about
    30x faster); this torch version is the reference and the fallback."""
    n, k = w.shape
    if native:
        lib = native_library()
        if lib is not None:
            return _quantize_int4_native(lib, w, refits)
    kp = round_up(k, 64)
    wg = torch.nn.functional.pad(w, (0, kp - k)).view(n, kp // INT4_GROUP, INT4_GROUP)  # [N, G, 32]
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s = ((hi - lo) / 15).clamp_min(1e-30)
    z = torch.round(-lo / s).clamp_(0, 15)
    sw, sww = wg.sum(-1, keepdim=True), (wg * wg).sum(-1, keepdim=True)
    best_err = best_s = best_z = None
    for step in range(refits + 1):
        q = torch.round(wg / s + z).clamp_(0, 15)
        sq, sqq, sqw = q.sum(-1, keepdim=True), (q * q).sum(-1, keepdim=True), (q * wg).sum(-1, keepdim=True)
        # sum (s (q - z) - w)^2 from the sums
        err = s * s * (sqq - 2 * z * sq + INT4_GROUP * z * z) - 2 * s * (sqw - z * sw) + sww
        if best_err is None:
            best_err, best_s, best_z = err, s, z
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
        if step == refits:
            break
        # least squares of w ~ s * q + c over the group, then the zero point nearest to -c / s
        var = sqq - sq * sq / INT4_GROUP
        s = torch.where(var > 0, (sqw - sq * sw / INT4_GROUP) / var.clamp_min(1e-12), s).clamp_min(1e-30)
        z = torch.round(-(sw - s * sq) / (INT4_GROUP * s)).clamp_(0, 15)
    row = (best_s.amax(dim=(1, 2)) / 255).clamp_min(1e-30)  # [N]
    gs = torch.round(best_s / row[:, None, None]).clamp_(1, 255)
    q = torch.round(wg / (gs * row[:, None, None]) + best_z).clamp_(0, 15).to(torch.uint8)
    codes = (q[..., 0::2] | (q[..., 1::2] << 4)).reshape(n, kp // 2)
    zeros = best_z.to(torch.uint8).view(n, kp // 64, 2)
    gzero = zeros[..., 0] | (zeros[..., 1] << 4)
    return QMatrix("int4", "rows", n, k, codes.contiguous(), row.contiguous(),
                   gs.to(torch.uint8).view(n, kp // INT4_GROUP).contiguous(), gzero.contiguous())


def _quantize_int4_native(lib, w: torch.Tensor, refits: int) -> QMatrix:
    n, k = w.shape
    kp = round_up(k, 64)
    w = w.contiguous()
    codes = torch.empty(n, kp // 2, dtype=torch.uint8)
    row = torch.empty(n, dtype=torch.float32)
    gscale = torch.empty(n, kp // INT4_GROUP, dtype=torch.uint8)
    gzero = torch.empty(n, kp // 64, dtype=torch.uint8)
    if lib.tm_quantize_int4(w.data_ptr(), n, k, refits, codes.data_ptr(), row.data_ptr(), gscale.data_ptr(),
                            gzero.data_ptr()) != 0:
        raise ValueError(f"int4 quantisation takes at most 262144 columns, got {k}")
    return QMatrix("int4", "rows", n, k, codes, row, gscale, gzero)


def dequantize(m: QMatrix, dtype: torch.dtype) -> torch.Tensor:
    """W [n, k] in `dtype` (from either layout)."""
    if m.layout == "blocked":
        m = unblock(m)
    if m.fmt == "bf16":
        return m.codes[: m.n, : m.k].to(dtype)
    if m.fmt == "int8":
        return (m.codes.to(torch.float32) * m.scale[:, None])[: m.n, : m.k].to(dtype)
    rows = m.codes.shape[0]
    q = torch.stack([m.codes & 15, m.codes >> 4], dim=-1).view(rows, -1, INT4_GROUP).to(torch.float32)
    zero = torch.stack([m.gzero & 15, m.gzero >> 4], dim=-1).view(rows, -1, 1).to(torch.float32)
    s = m.gscale.to(torch.float32)[..., None] * m.scale[:, None, None]
    return (s * (q - zero)).view(rows, -1)[: m.n, : m.k].to(dtype)


def block(m: QMatrix, row_segments: tuple[tuple[int, int], ...] | None = None, segment_rows: int | None = None) -> QMatrix:
    """The "blocked" layout of a "rows" matrix, padded to strips of 16 rows and `k_align` columns.

    row_segments / segment_rows: copy each segment of rows [a, b) to the start of its own block of `segment_rows`
    rows (how gate_up [2I, D] becomes [gate rows, zeros, up rows, zeros] with I padded, as the kernels expect).
    """
    segments = row_segments or ((0, m.n),)
    seg_rows = segment_rows or round_up(m.n, 16)
    n_pad, k_pad = seg_rows * len(segments), round_up(m.k, k_align(m.fmt))

    identity = segments == ((0, m.n),) or all(a == i * seg_rows and b - a == seg_rows for i, (a, b) in enumerate(segments))

    def rows_of(t: torch.Tensor, cols: int) -> torch.Tensor:  # [rows, cols] -> [n_pad, cols], segments placed
        if identity and t.shape == (n_pad, cols):
            return t
        out = torch.zeros(n_pad, cols, dtype=t.dtype)
        for i, (a, b) in enumerate(segments):
            out[i * seg_rows: i * seg_rows + b - a, : t.shape[1]] = t[a:b]
        return out

    if m.fmt in ("bf16", "int8"):
        # move whole k pairs (4 or 2 bytes) at once: a transpose of wider elements is much faster
        pair = torch.int32 if m.fmt == "bf16" else torch.int16
        pairs = rows_of(m.codes, k_pad).view(pair).view(n_pad // 16, 16, k_pad // 2)
        codes = pairs.transpose(1, 2).contiguous().view(m.codes.dtype).view(n_pad // 16, k_pad // 2, 16, 2)
    else:
        codes = rows_of(m.codes, k_pad // 2).view(n_pad // 16, 16, k_pad // 2).transpose(1, 2).contiguous()
    out = replace(m, layout="blocked", codes=codes, segments=segments, segment_rows=seg_rows)
    if m.scale is not None:
        out.scale = rows_of(m.scale[:, None], 1)[:, 0].contiguous()
    if m.fmt == "int4":
        out.gscale = rows_of(m.gscale, k_pad // 32).view(n_pad // 16, 16, -1).permute(0, 2, 1).contiguous()
        out.gzero = rows_of(m.gzero, k_pad // 64).view(n_pad // 16, 16, -1).permute(0, 2, 1).contiguous()
    return out


def unblock(m: QMatrix) -> QMatrix:
    """The "rows" layout of a "blocked" matrix (inverse of `block`)."""
    segments, seg_rows = m.segments, m.segment_rows
    n_pad = m.codes.shape[0] * 16

    def rows_back(t: torch.Tensor) -> torch.Tensor:  # [n_pad, cols] -> [n, cols]
        return torch.cat([t[i * seg_rows: i * seg_rows + b - a] for i, (a, b) in enumerate(segments)])

    if m.fmt in ("bf16", "int8"):
        pair = torch.int32 if m.fmt == "bf16" else torch.int16
        # contiguous: with one strip (n_pad 16) the reshape is a strided view, which cannot be viewed bytewise
        pairs = m.codes.view(pair).view(n_pad // 16, -1, 16).transpose(1, 2).reshape(n_pad, -1).contiguous()
        codes = rows_back(pairs.view(m.codes.dtype))[:, : m.k]
    else:
        codes = rows_back(m.codes.permute(0, 2, 1).reshape(n_pad, -1))
    out = QMatrix(m.fmt, "rows", m.n, m.k, codes.contiguous())
    if m.scale is not None:
        out.scale = rows_back(m.scale[:, None])[:, 0].contiguous()
    if m.fmt == "int4":
        out.gscale = rows_back(m.gscale.permute(0, 2, 1).reshape(n_pad, -1)).contiguous()
        out.gzero = rows_back(m.gzero.permute(0, 2, 1).reshape(n_pad, -1)).contiguous()
    return out


def kernels_take_shape(fmt: str, d: int, i: int) -> bool:
    """Whether the kernels compute experts of hidden size D and intermediate size I in `fmt`: int8 / int4 always
    (padded when packed), bf16 only in multiples of 32, so that no padding is ever held for bf16 weights."""
    return fmt != "bf16" or (d % k_align("bf16") == 0 and i % k_align("bf16") == 0)


def expert_in_layout(gate_up: QMatrix, down: QMatrix, layout: str) -> tuple[QMatrix, QMatrix]:
    """An expert's gate_up [2I, D] and down [D, I] in `layout`, re-laid-out only where they differ; "blocked"
    gives gate and up rows blocks of their own, I padded to `k_align`, as the kernels read them."""
    i = down.k
    if gate_up.layout != layout:
        gate_up = unblock(gate_up) if layout == "rows" else block(gate_up, ((0, i), (i, 2 * i)),
                                                                    round_up(i, k_align(gate_up.fmt)))
    if down.layout != layout:
        down = unblock(down) if layout == "rows" else block(down)
    return gate_up, down


def blocked_nbytes(fmt: str, n: int, k: int) -> int:
    """Bytes `block(quantize(w, fmt))` holds for a W [n, k] (one segment), from the shape alone: what `tiermoe
    fit` counts for a matrix before it is loaded."""
    n_pad, k_pad = round_up(n, 16), round_up(k, k_align(fmt))
    if fmt == "bf16":
        return 2 * n_pad * k_pad
    if fmt == "int8":
        return n_pad * k_pad + 4 * n_pad
    if fmt == "int4":
        return n_pad * k_pad // 2 + 4 * n_pad + n_pad * k_pad // INT4_GROUP + n_pad * k_pad // 64
    raise ValueError(f"unknown weight format '{fmt}'; choose one of: {', '.join(FORMATS)}")
