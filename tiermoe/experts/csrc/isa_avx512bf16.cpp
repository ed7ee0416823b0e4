// AVX512-BF16 kernels: bf16 weights times bf16 activations with VDPBF16PS, fp32 accumulation.
//
// One 64-byte line of a packed strip holds 16 rows x 2 consecutive k, which is exactly VDPBF16PS's operand: each
// lane adds w[n][k] * x[k] + w[n][k+1] * x[k+1], with the activation pair broadcast as one 32-bit value. So a
// token costs one load and one instruction per 64 bytes of weights, and decode runs at the speed memory streams.
// int8 / int4 weights multiply activations quantised to int8 with VPDPBUSD (int8_activations.inc; every CPU with
// AVX512-BF16 has AVX512-VNNI, and the level requires both); their other kernels are the portable ones.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#define TM_GEN_VEC 512
#define TM_GEN_MT 4
#include "generic_kernels.inc"
#define TM_ATTN_DPBF16 1
#include "decode_attention.inc"
#include "gated_delta.inc"

namespace {

// How far ahead (bytes) each strip's stream is prefetched, into L2 (T1): the hardware prefetcher stops at 4 KiB
// pages. Into L1 (T0, 1 KiB ahead, as before) it cost a fifth of the bandwidth: one bf16 product of Qwen3's LM head
// (151,936 x 2,048, one row, a team of two) read 26.6-28.5 GB/s against 32.6-34.1 with this and 31.8-33.4 with no
// software prefetch at all (libraries built both ways, alternating in one process, 15 calls each, 2026-12-04).
constexpr int kPrefetch = 2048;
constexpr int kMaxRows = 8;

}  // namespace

#include "int8_activations.inc"

namespace {

template <int MT, int S>
inline void dot_dp(const TmMatrix* W, const int* strip, const uint16_t* x, int ldx, v16f (&out)[MT][S]) {
  const int K = W->K;
  const uint8_t* base[S];
  for (int s = 0; s < S; ++s) base[s] = (const uint8_t*)W->codes + (size_t)K * 32 * strip[s];
  __m512 acc[MT][S];
  for (int m = 0; m < MT; ++m)
    for (int s = 0; s < S; ++s) acc[m][s] = _mm512_setzero_ps();
  for (int p = 0; p < K / 2; ++p) {
    __m512i a[MT];
    for (int m = 0; m < MT; ++m) {
      int32_t pair;
      __builtin_memcpy(&pair, x + (size_t)m * ldx + 2 * p, 4);
      a[m] = _mm512_set1_epi32(pair);
    }
    for (int s = 0; s < S; ++s) {
      const uint8_t* line = base[s] + 64 * (size_t)p;
      if ((p & 1) == 0) _mm_prefetch((const char*)line + kPrefetch, _MM_HINT_T1);
      __m512i w = _mm512_loadu_si512(line);
      for (int m = 0; m < MT; ++m) acc[m][s] = _mm512_dpbf16_ps(acc[m][s], (__m512bh)w, (__m512bh)a[m]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int s = 0; s < S; ++s) out[m][s] = (v16f)acc[m][s];
}

template <int MT>
void up_dp_tile(const TmMatrix* W, const TmGlu* glu, const uint16_t* x, int ldx, int j, float* hf, uint16_t* hb,
                int ldh, int m0) {
  const int strip[2] = {j, W->N / 32 + j};
  v16f acc[MT][2];
  dot_dp<MT, 2>(W, strip, x, ldx, acc);
  store_glu<MT>(W, glu, strip, acc, j, hf, hb, ldh, m0);  // bf16: row scales 1, exact
}

template <int MT, int S>
void down_dp_tile(const TmMatrix* W, const uint16_t* h, int ldh, int c, int c0, const int32_t* out, const float* w,
                  float* y, int ldy) {
  int strip[S];
  for (int s = 0; s < S; ++s) strip[s] = c + s;
  v16f acc[MT][S];
  dot_dp<MT, S>(W, strip, h, ldh, acc);
  add_weighted<MT, S>(W, c, c0, acc, out, w, y, ldy);  // bf16: row scales 1, exact
}

#define TM_ROWS_SWITCH(n, CALL) \
  switch (n) {                  \
    case 1: CALL(1); break;     \
    case 2: CALL(2); break;     \
    case 3: CALL(3); break;     \
    case 4: CALL(4); break;     \
    case 5: CALL(5); break;     \
    case 6: CALL(6); break;     \
    case 7: CALL(7); break;     \
    default: CALL(8); break;    \
  }

void up_bf16(const TmMatrix* W, const TmGlu* glu, const TmRows* x, int j0, int j1, float* hf, uint16_t* hb, int ldh,
             void* scratch) {
  if (W->fmt == TM_INT8) return up_q8<TM_INT8>(W, glu, x, j0, j1, hf, hb, ldh, scratch);
  if (W->fmt == TM_INT4) return up_q8<TM_INT4>(W, glu, x, j0, j1, hf, hb, ldh, scratch);
  if (W->fmt == TM_INT6) return up_q8<TM_INT6>(W, glu, x, j0, j1, hf, hb, ldh, scratch);
  const int M = x->M;
  for (int j = j0; j < j1; ++j)
    for (int m0 = 0; m0 < M; m0 += kMaxRows) {
      const uint16_t* xm = x->bf16 + (size_t)m0 * x->ld;
      float* hfm = hf ? hf + (size_t)m0 * ldh : nullptr;
      uint16_t* hbm = hb ? hb + (size_t)m0 * ldh : nullptr;
#define TM_UP(R) up_dp_tile<R>(W, glu, xm, x->ld, j, hfm, hbm, ldh, m0)
      TM_ROWS_SWITCH(M - m0, TM_UP)
#undef TM_UP
    }
}

void down_bf16(const TmMatrix* W, const TmRows* h, int c0, int c1, const int32_t* out, const float* w, float* y,
               int ldy, void* scratch) {
  if (W->fmt == TM_INT8) return down_q8<TM_INT8>(W, h, c0, c1, out, w, y, ldy, scratch);
  if (W->fmt == TM_INT4) return down_q8<TM_INT4>(W, h, c0, c1, out, w, y, ldy, scratch);
  if (W->fmt == TM_INT6) return down_q8<TM_INT6>(W, h, c0, c1, out, w, y, ldy, scratch);
  const int M = h->M;
  for (int c = c0; c < c1; c += 2)
    for (int m0 = 0; m0 < M; m0 += kMaxRows) {
      const uint16_t* hm = h->bf16 + (size_t)m0 * h->ld;
      if (c + 1 < c1) {
#define TM_DOWN2(R) down_dp_tile<R, 2>(W, hm, h->ld, c, c0, out + m0, w + m0, y, ldy)
        TM_ROWS_SWITCH(M - m0, TM_DOWN2)
#undef TM_DOWN2
      } else {
#define TM_DOWN1(R) down_dp_tile<R, 1>(W, hm, h->ld, c, c0, out + m0, w + m0, y, ldy)
        TM_ROWS_SWITCH(M - m0, TM_DOWN1)
#undef TM_DOWN1
      }
    }
}

// The transposed product for bf16 weights times bf16 activations (the caller picks this table for bf16 activations
// only, and bf16 weights carry no row scale, so g's bf16 copy is exact). VDPBF16PS sums pairs within its 32-bit
// lanes, but a line pairs two k of one row; permuting the line's 16-bit halves (the evens, then the odds) makes
// lane j hold rows 2j and 2j + 1 of column 2p (lanes 0-7) or 2p + 1 (lanes 8-15), which meet g's own consecutive
// rows, broadcast to both halves: one instruction per line and token where the portable kernel needs two FMAs, and
// the permutation is shared by the tile's kTransposedRows tokens.
constexpr int kTransposedRows = 8, kTransposedPairs = 2;

typedef float v8f __attribute__((vector_size(32)));

inline float hsum8(v8f a) {
  typedef float v4f __attribute__((vector_size(16)));
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

template <int MT>
void transposed_dp_tile(const TmMatrix* W, const uint16_t* g, int ldg, int p, float* out, int ldo) {
  const int S = W->N / 16;
  const size_t sb = (size_t)W->K * 32;
  const uint8_t* line = (const uint8_t*)W->codes + 64 * (size_t)p;
  const __m512i evens_then_odds = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                                                   30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  __m512 acc[MT][kTransposedPairs];
  for (int m = 0; m < MT; ++m)
    for (int q = 0; q < kTransposedPairs; ++q) acc[m][q] = _mm512_setzero_ps();
  for (int s = 0; s < S; ++s, line += sb) {
    for (int b = 0; b < kTransposedPairs * 64; b += 64) _mm_prefetch((const char*)line + 4 * sb + b, _MM_HINT_T0);
    __m512i t[kTransposedPairs];
    for (int q = 0; q < kTransposedPairs; ++q)
      t[q] = _mm512_permutexvar_epi16(evens_then_odds, _mm512_loadu_si512(line + 64 * q));
    for (int m = 0; m < MT; ++m) {
      const uint16_t* gs = g + (size_t)m * ldg + 16 * s;
      if ((s & 1) == 0) _mm_prefetch((const char*)gs + 256, _MM_HINT_T0);  // rows of g stream from L2 when M is large
      const __m512i gp = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)gs));
      for (int q = 0; q < kTransposedPairs; ++q) acc[m][q] = _mm512_dpbf16_ps(acc[m][q], (__m512bh)t[q], (__m512bh)gp);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int q = 0; q < kTransposedPairs; ++q) {
      const v16f v = (v16f)acc[m][q];
      out[(size_t)m * ldo + 2 * q] = hsum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7));
      out[(size_t)m * ldo + 2 * q + 1] = hsum8(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
    }
}

void transposed_bf16(const TmMatrix* W, const TmRows* g, int p0, int p1, float* out, int ldo) {
  if (W->fmt != TM_BF16) return transposed_generic(W, g, p0, p1, out, ldo);
  const int M = g->M;
  for (int p = p0; p < p1; p += kTransposedPairs)
    for (int m0 = 0; m0 < M; m0 += kTransposedRows) {
      const uint16_t* gm = g->bf16 + (size_t)m0 * g->ld;
      float* om = out + (size_t)m0 * ldo + 2 * (p - p0);
#define TM_T(R) transposed_dp_tile<R>(W, gm, g->ld, p, om, ldo)
      TM_ROWS_SWITCH(M - m0, TM_T)
#undef TM_T
    }
}

int wants_bf16(int fmt, int) { return fmt == TM_BF16 ? TM_ROWS_BF16 : TM_ROWS_F32; }

size_t scratch_bf16(int K, int M) {
  const size_t exact = scratch_generic(K, M), q8 = q8_scratch_bytes(K, M);
  return exact > q8 ? exact : q8;
}

const TmKernels kTable = {TM_ISA_AVX512BF16, wants_bf16, scratch_bf16, up_bf16, down_bf16, finish_nothing,
                           transposed_bf16, to_bf16_generic, transpose_group_generic,
                           attend_scratch_floats, attend_task, delta_task};

}  // namespace

extern "C" const TmKernels* tm_kernels_avx512bf16(void) { return &kTable; }
