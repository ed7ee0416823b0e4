"""Expert weight formats of the CPU tier: quantise once at load, pack for the kernels, and give weights back.

A matrix W [N, K] (N outputs, K inputs; gate_up is [2I, D], down [D, I]) is stored in one of four formats:
  bf16  w as bf16.                                                                   2 bytes / param
  int8  per output row, symmetric: w = scale[n] * q, q in [-127, 127].              1 byte / param + 4 per row
  int4  groups of 32 along K, asymmetric with an integer zero point:
        w = scale[n] * gscale[n, g] * (q - zero[n, g]), q and zero 4-bit, gscale 8-bit (1..255) relative to the
        row's fp32 scale. 4 + 4/32 + 8/32 = 4.375 bits = 0.547 bytes / param + 4 per row.
  int6  as int4 with 6-bit codes and zero points (a byte each): 6 + 8/32 + 8/32 = 6.5 bits = 0.8125 bytes / param
        + 4 per row, Q6_K's 6.56 bits; what an int4 model holds where 4 bits cost most (its head, attention's output
        and the experts' down projections: tiermoe.model.non_expert_quant, BENCHMARKS.md "int6").

Why these: int8 per row keeps every dequantised weight exact in bf16, so AMX can multiply it; int4 with groups of
32 is the smallest group that fits 0.56 bytes / param, and an integer zero point plus a least-squares refit of
each group's scale and offset lowers the error of plain min/max rounding by about 10 %; int6 shares int4's groups
and algorithm, so every kernel reads both through one path.

Two layouts. "rows" is W's own row order (K padded to 64 for int4 / int6 so groups pair up in bytes; int6: a row's
low nibbles, then its high 2-bit pairs): what the pure-torch path computes with and what `dequantize` reads.
"blocked" is what the C++ kernels read (csrc/tm_kernels.h): rows in strips of 16 and consecutive k pairs
interleaved, [N/16][K/2][16][2], which is also the AMX B-tile layout; int4 in chunks of 4 such lines interleaved by
row (byte 4r + i: row r's line i, the 4 bytes VPDPBUSD takes in one lane), held as [N/16][K/2][16]; int6 in groups
of 384 bytes, low nibbles as int4's then the high bits, held as [N/16][K/2][24].
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tiermoe.experts.kernels import native_library

FORMATS = ("bf16", "int8", "int4", "int6")
FORMAT_CODES = {"bf16": 0, "int8": 1, "int4": 2, "int6": 3}
GROUPED = ("int4", "int6")  # formats in groups of 32 k with a scale and zero point each
TOP_CODE = {"int4": 15, "int6": 63}
INT4_GROUP = 32


def k_align(fmt: str) -> int:
    """Columns (K) a packed matrix is padded to: AMX tiles take 32 k; int4 stores two groups of 32 per zero byte
    (int6 pads as int4, so an expert's gate_up and down may be held one in each with the same padded sizes)."""
    return 64 if fmt in GROUPED else 32


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class QMatrix:
    """One stored matrix. `n`, `k` are W's true shape; padded rows / columns hold zeros."""

    fmt: str
    layout: str  # "rows" | "blocked"
    n: int
    k: int
    codes: torch.Tensor  # bf16 / int8 / uint8 (int4: two codes per byte, low nibble = even k; int6: see above)
    scale: torch.Tensor | None = None  # fp32 [Np]: int8 channel scale, int4 / int6 row scale
    gscale: torch.Tensor | None = None  # uint8 int4 / int6 group scales
    gzero: torch.Tensor | None = None  # uint8 zero points: int4 two groups per byte (low nibble = even group), int6 one
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
    if fmt in GROUPED:
        return _quantize_grouped(w, fmt)
    raise ValueError(f"unknown expert weight format '{fmt}'; choose one of: {', '.join(FORMATS)}")


def _quantize_grouped(w: torch.Tensor, fmt: str, refits: int = 2, native: bool = True) -> QMatrix:
    """int4 / int6 in groups of 32: start from each group's min/max, refit scale and offset by least squares a few
    times (keeping each group's best), then store the scale as 8 bits of the row's largest and re-round the codes to
    it.

    Per-group sums (of q, q^2, q*w) give both the fit and the squared error, so each refit costs one rounding
    pass and three reductions over the weights. The kernel library has the same algorithm fused per group (about
    30x faster); this torch version is the reference and the fallback."""
    n, k = w.shape
    if native:
        lib = native_library()
        if lib is not None:
            return _quantize_grouped_native(lib, w, fmt, refits)
    top = TOP_CODE[fmt]
    kp = round_up(k, 64)
    wg = torch.nn.functional.pad(w, (0, kp - k)).view(n, kp // INT4_GROUP, INT4_GROUP)  # [N, G, 32]
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s = ((hi - lo) / top).clamp_min(1e-30)
    z = torch.round(-lo / s).clamp_(0, top)
    sw, sww = wg.sum(-1, keepdim=True), (wg * wg).sum(-1, keepdim=True)
    best_err = best_s = best_z = None
    for step in range(refits + 1):
        q = torch.round(wg / s + z).clamp_(0, top)
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
        z = torch.round(-(sw - s * sq) / (INT4_GROUP * s)).clamp_(0, top)
    row = (best_s.amax(dim=(1, 2)) / 255).clamp_min(1e-30)  # [N]
    gs = torch.round(best_s / row[:, None, None]).clamp_(1, 255)
    q = torch.round(wg / (gs * row[:, None, None]) + best_z).clamp_(0, top).to(torch.uint8).view(n, kp)
    zeros = best_z.to(torch.uint8).view(n, kp // INT4_GROUP)
    return QMatrix(fmt, "rows", n, k, _rows_codes(q, fmt), row.contiguous(),
                   gs.to(torch.uint8).view(n, kp // INT4_GROUP).contiguous(), _rows_zeros(zeros, fmt))


def _rows_codes(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes q [N, Kp] (uint8) as the "rows" layout stores them: low nibbles two a byte (k even in the low one);
    int6 then its high 2-bit pairs, four a byte (k % 4 in bits 2 (k % 4) and up)."""
    lo = q & 15
    codes = lo[:, 0::2] | (lo[:, 1::2] << 4)
    if fmt == "int6":
        hi = (q >> 4).view(q.shape[0], -1, 4)
        codes = torch.cat([codes, hi[..., 0] | (hi[..., 1] << 2) | (hi[..., 2] << 4) | (hi[..., 3] << 6)], dim=1)
    return codes.contiguous()


def _rows_zeros(z: torch.Tensor, fmt: str) -> torch.Tensor:
    """Zero points z [N, G] (uint8) as stored: int4 two groups a byte (the even one low), int6 one a byte."""
    return (z if fmt == "int6" else z[:, 0::2] | (z[:, 1::2] << 4)).contiguous()


def _codes_of_rows(m: QMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """A "rows" int4 / int6 matrix's codes [rows, Kp] and zero points [rows, G], one uint8 each (inverse of
    `_rows_codes` and `_rows_zeros`)."""
    rows = m.codes.shape[0]
    kp = m.codes.shape[1] * 2 if m.fmt == "int4" else m.codes.shape[1] * 4 // 3
    nib = m.codes[:, : kp // 2]
    q = torch.stack([nib & 15, nib >> 4], dim=-1).view(rows, kp)
    if m.fmt == "int4":
        return q, torch.stack([m.gzero & 15, m.gzero >> 4], dim=-1).view(rows, -1)
    hi = m.codes[:, kp // 2:]
    hi = torch.stack([hi & 3, (hi >> 2) & 3, (hi >> 4) & 3, hi >> 6], dim=-1).view(rows, kp)
    return q | (hi << 4), m.gzero


def _quantize_grouped_native(lib, w: torch.Tensor, fmt: str, refits: int) -> QMatrix:
    n, k = w.shape
    kp = round_up(k, 64)
    w = w.contiguous()
    codes = torch.empty(n, kp // 2 if fmt == "int4" else 3 * kp // 4, dtype=torch.uint8)
    row = torch.empty(n, dtype=torch.float32)
    gscale = torch.empty(n, kp // INT4_GROUP, dtype=torch.uint8)
    gzero = torch.empty(n, kp // (64 if fmt == "int4" else INT4_GROUP), dtype=torch.uint8)
    quantise = lib.tm_quantize_int4 if fmt == "int4" else lib.tm_quantize_int6
    if quantise(w.data_ptr(), n, k, refits, codes.data_ptr(), row.data_ptr(), gscale.data_ptr(),
                gzero.data_ptr()) != 0:
        raise ValueError(f"{fmt} quantisation takes at most 262144 columns, got {k}")
    return QMatrix(fmt, "rows", n, k, codes, row, gscale, gzero)


def dequantize(m: QMatrix, dtype: torch.dtype) -> torch.Tensor:
    """W [n, k] in `dtype` (from either layout)."""
    if m.layout == "blocked":
        m = unblock(m)
    if m.fmt == "bf16":
        return m.codes[: m.n, : m.k].to(dtype)
    if m.fmt == "int8":
        return (m.codes.to(torch.float32) * m.scale[:, None])[: m.n, : m.k].to(dtype)
    rows = m.codes.shape[0]
    q, zero = _codes_of_rows(m)
    q = q.view(rows, -1, INT4_GROUP).to(torch.float32)
    zero = zero.view(rows, -1, 1).to(torch.float32)
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
    elif m.fmt == "int4":
        codes = _chunked(rows_of(m.codes, k_pad // 2).view(n_pad // 16, 16, k_pad // 8, 4))
    else:
        codes = _int6_blocked(rows_of(_codes_of_rows(m)[0], k_pad))
    out = replace(m, layout="blocked", codes=codes, segments=segments, segment_rows=seg_rows)
    if m.scale is not None:
        out.scale = rows_of(m.scale[:, None], 1)[:, 0].contiguous()
    if m.fmt in GROUPED:
        zero_cols = k_pad // (64 if m.fmt == "int4" else INT4_GROUP)
        out.gscale = rows_of(m.gscale, k_pad // 32).view(n_pad // 16, 16, -1).permute(0, 2, 1).contiguous()
        out.gzero = rows_of(m.gzero, zero_cols).view(n_pad // 16, 16, -1).permute(0, 2, 1).contiguous()
    return out


def _chunked(lines: torch.Tensor) -> torch.Tensor:
    """int4 low-nibble bytes [S, 16 rows, C chunks, 4 lines] as the kernels hold them, [S, 4C, 16]: each chunk of 4
    lines 64 bytes, byte 4r + i row r's line i (what one 32-bit lane of VPDPBUSD takes: csrc/tm_kernels.h)."""
    s, _, c, _ = lines.shape
    return lines.permute(0, 2, 1, 3).reshape(s, 4 * c, 16)


def _unchunked(codes: torch.Tensor) -> torch.Tensor:
    """The [S, 16 rows, C chunks, 4 lines] of int4 codes held as `_chunked` gives them (its inverse)."""
    s, lines, _ = codes.shape
    return codes.view(s, lines // 4, 16, 4).permute(0, 2, 1, 3)


def _int6_blocked(q: torch.Tensor) -> torch.Tensor:
    """int6 codes q [Np, Kp] (one uint8 each) in the kernels' layout (csrc/tm_kernels.h), as [Np/16, Kp/2, 24]: per
    strip and group of 32 k, 16 lines of low nibbles held as int4's (`_chunked`), then two blocks of high bits,
    block h holding row r's lines 8h + i and 8h + 4 + i in byte 4r + i (k even in bits 0-1, odd in 2-3; the second
    line 4 up)."""
    s, g = q.shape[0] // 16, q.shape[1] // INT4_GROUP
    qg = q.view(s, 16, g, INT4_GROUP)  # [S, r, G, k]
    lo = qg & 15
    nibbles = (lo[..., 0::2] | (lo[..., 1::2] << 4)).reshape(s, 16, 4 * g, 4)  # [S, r, chunk, line % 4]
    lines = _chunked(nibbles).view(s, g, 256)
    hi = (qg >> 4).view(s, 16, g, 2, 2, 4, 2)  # [S, r, G, h, line // 4 % 2, line % 4, k % 2]
    pairs = hi[..., 0] | (hi[..., 1] << 2)
    blocks = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [S, G, h, r, i]
    group = torch.cat([lines, blocks.reshape(s, g, 128)], dim=2)
    return group.reshape(s, g * 16, 24).contiguous()


def _int6_unblocked(codes: torch.Tensor) -> torch.Tensor:
    """The codes [Np, Kp] (one uint8 each) of an int6 blocked matrix's codes (inverse of `_int6_blocked`)."""
    s, g = codes.shape[0], codes.shape[1] // 16
    group = codes.reshape(s, g, 384)
    lines = _unchunked(group[..., :256].reshape(s, 16 * g, 16)).reshape(s, 16, g, 16)  # [S, r, G, line]
    lo = torch.stack([lines & 15, lines >> 4], dim=-1).reshape(s, 16, g, INT4_GROUP)
    blocks = group[..., 256:].reshape(s, g, 2, 16, 4).permute(0, 3, 1, 2, 4)  # [S, r, G, h, i]
    pairs = torch.stack([blocks & 15, blocks >> 4], dim=-2)  # [S, r, G, h, line // 4 % 2, i]
    hi = torch.stack([pairs & 3, pairs >> 2], dim=-1).reshape(s, 16, g, INT4_GROUP)
    return (lo | (hi << 4)).reshape(16 * s, INT4_GROUP * g)


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
    elif m.fmt == "int4":
        codes = rows_back(_unchunked(m.codes).reshape(n_pad, -1))
    else:
        codes = _rows_codes(rows_back(_int6_unblocked(m.codes)), "int6")
    out = QMatrix(m.fmt, "rows", m.n, m.k, codes.contiguous())
    if m.scale is not None:
        out.scale = rows_back(m.scale[:, None])[:, 0].contiguous()
    if m.fmt in GROUPED:
        out.gscale = rows_back(m.gscale.permute(0, 2, 1).reshape(n_pad, -1)).contiguous()
        out.gzero = rows_back(m.gzero.permute(0, 2, 1).reshape(n_pad, -1)).contiguous()
    return out


def kernels_take_shape(fmt: str, d: int, i: int) -> bool:
    """Whether the kernels compute experts of hidden size D and intermediate size I in `fmt`: int8 / int4 / int6 always
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
    if fmt == "int6":
        return n_pad * k_pad * 3 // 4 + 4 * n_pad + 2 * n_pad * k_pad // INT4_GROUP
    raise ValueError(f"unknown weight format '{fmt}'; choose one of: {', '.join(FORMATS)}")
