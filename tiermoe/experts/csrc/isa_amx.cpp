// AMX kernels: many tokens per expert (prefill), bf16 tiles, fp32 accumulation.
//
// Tiles 0-3 accumulate a 32x32 block of outputs (2 row tiles x 2 column strips), tiles 4-5 hold 16 tokens x 32 k
// of activations, tiles 6-7 hold 32 k x 16 outputs of weights. A packed strip is already the B-tile layout, so bf16
// weights are loaded straight from memory; int8 / int4 strips are first dequantised into a bf16 strip in L2
// scratch (once per strip, reused by every row tile). Rows of activations are bf16, allocated up to a multiple of
// 16 rows (the extra rows are computed and ignored).
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>

#define TM_GEN_VEC 512
#define TM_GEN_MT 4
#include "generic_kernels.inc"
#define TM_ATTN_DPBF16 1
#include "decode_attention.inc"
#include "gated_delta.inc"

namespace {

constexpr int kPrefetchBlocks = 4;  // bf16 strips stream from memory: prefetch this many 1 KiB tiles ahead

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure_tiles() {
  TileConfig cfg = {};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// C[MA row tiles][NB strips] (16x16 fp32 each, in that order) = A rows . B strips over K.
template <int MA, int NB>
void amx_block(const uint16_t* a, int lda, const uint16_t* const* b, int K, bool prefetch, float* C) {
  _tile_zero(0);
  if (NB == 2) _tile_zero(1);
  if (MA == 2) _tile_zero(2);
  if (MA == 2 && NB == 2) _tile_zero(3);
  const uint16_t* a1 = a + (size_t)16 * lda;
  for (int kb = 0; kb < K / 32; ++kb) {
    if (prefetch)
      for (int s = 0; s < NB; ++s)
        for (int l = 0; l < 16; ++l) _mm_prefetch((const char*)(b[s] + (size_t)(kb + kPrefetchBlocks) * 512 + 32 * l), _MM_HINT_T0);
    _tile_loadd(4, a + 32 * kb, lda * 2);
    _tile_loadd(6, b[0] + (size_t)512 * kb, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NB == 2) {
      _tile_loadd(7, b[1] + (size_t)512 * kb, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (MA == 2) {
      _tile_loadd(5, a1 + 32 * kb, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, C, 64);
  if (NB == 2) _tile_stored(1, C + 256, 64);
  if (MA == 2) _tile_stored(2, C + 256 * NB, 64);
  if (MA == 2 && NB == 2) _tile_stored(3, C + 768, 64);
}

void amx_any(int ma, int nb, const uint16_t* a, int lda, const uint16_t* const* b, int K, bool prefetch, float* C) {
  if (ma == 2 && nb == 2) amx_block<2, 2>(a, lda, b, K, prefetch, C);
  else if (ma == 2) amx_block<2, 1>(a, lda, b, K, prefetch, C);
  else if (nb == 2) amx_block<1, 2>(a, lda, b, K, prefetch, C);
  else amx_block<1, 1>(a, lda, b, K, prefetch, C);
}

// Dequantise one 16-row strip into bf16 pairs (the B-tile layout). int8 keeps integer values (exact in bf16;
// the channel scale is applied to the outputs); int4 and int6 fold the row, group scale and zero in (int6 by the
// portable conversion: its decode steps are all in reading the matrix).
void dequant_strip(const TmMatrix* W, int strip, uint16_t* dst) {
  const int K = W->K;
  if (W->fmt == TM_INT6) return to_bf16_generic(W, strip, 0, K / 2, dst);
  if (W->fmt == TM_INT8) {
    const uint8_t* src = (const uint8_t*)W->codes + (size_t)K * 16 * strip;
    for (int p = 0; p < K / 2; ++p) {
      __m256i raw = _mm256_loadu_si256((const __m256i*)(src + 32 * (size_t)p));
      __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
      __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
      _mm512_storeu_si512(dst + 32 * (size_t)p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    return;
  }
  const int G = K / 32;
  const uint8_t* src = (const uint8_t*)W->codes + (size_t)K * 8 * strip;
  const __m512 row = _mm512_loadu_ps(W->scale + 16 * (size_t)strip);
  const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512i nib = _mm512_set1_epi32(15);
  for (int g = 0; g < G; ++g) {
    __m512 s = _mm512_mul_ps(row, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                      _mm_loadu_si128((const __m128i*)(W->gscale + 16 * ((size_t)strip * G + g))))));
    __m512i zb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(W->gzero + 16 * ((size_t)strip * (G / 2) + g / 2))));
    __m512 z = _mm512_cvtepi32_ps((g & 1) ? _mm512_srli_epi32(zb, 4) : _mm512_and_si512(zb, nib));
    for (int p = 16 * g; p < 16 * g + 16; ++p) {  // line p: byte p % 4 of each row's lane in its 4-line chunk
      const __m512i chunk = _mm512_loadu_si512(src + 64 * (size_t)(p / 4));
      __m512i q = _mm512_and_si512(_mm512_srlv_epi32(chunk, _mm512_set1_epi32(8 * (p % 4))), _mm512_set1_epi32(0xFF));
      __m512 lo = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, nib)), z), s);
      __m512 hi = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), z), s);
      __m512 e0 = _mm512_permutex2var_ps(lo, even, hi), e1 = _mm512_permutex2var_ps(lo, odd, hi);
      _mm512_storeu_si512(dst + 32 * (size_t)p, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
  }
}

// The bf16 strip to multiply: the packed weights themselves, or their dequantised copy in scratch.
const uint16_t* strip_bf16(const TmMatrix* W, int strip, uint16_t* scratch) {
  if (W->fmt == TM_BF16) return (const uint16_t*)W->codes + (size_t)W->K * 16 * strip;
  dequant_strip(W, strip, scratch);
  return scratch;
}

// The factor each output column still needs: the channel scale for int8 (int4 / int6 folded it in), 1 otherwise.
v16f column_scale(const TmMatrix* W, int strip) {
  return W->fmt == TM_INT8 ? ld_f32x16(W->scale + 16 * (size_t)strip) : splat(1.0f);
}

struct Scratch {
  uint16_t* b[2];
  float* C;
};

Scratch split_scratch(void* scratch, int K) {
  uintptr_t p = ((uintptr_t)scratch + 63) & ~(uintptr_t)63;
  Scratch s;
  s.C = (float*)p;
  s.b[0] = (uint16_t*)(p + 4096);
  s.b[1] = s.b[0] + (size_t)K * 16;
  return s;
}

size_t scratch_amx(int K, int) { return 64 + 4096 + (size_t)K * 64; }

void up_amx(const TmMatrix* W, const TmGlu* glu, const TmRows* x, int j0, int j1, float* hf, uint16_t* hb, int ldh,
            void* scratch) {
  configure_tiles();
  const int K = W->K, Ih = W->N / 32, M = x->M, Mt = (M + 15) / 16;
  Scratch sc = split_scratch(scratch, K);
  for (int j = j0; j < j1; ++j) {
    const int strip[2] = {j, Ih + j};
    const uint16_t* b[2] = {strip_bf16(W, j, sc.b[0]), strip_bf16(W, Ih + j, sc.b[1])};
    const v16f sg = column_scale(W, j), su = column_scale(W, Ih + j);
    for (int mt = 0; mt < Mt; mt += 2) {
      const int ma = mt + 1 < Mt ? 2 : 1;
      amx_any(ma, 2, x->bf16 + (size_t)16 * mt * x->ld, x->ld, b, K, W->fmt == TM_BF16, sc.C);
      for (int t = 0; t < ma; ++t)
        for (int r = 0; r < 16 && 16 * (mt + t) + r < M; ++r) {
          const int m = 16 * (mt + t) + r;
          v16f h = glu16(glu, strip, ld_f32x16(sc.C + 512 * t + 16 * r) * sg,
                         ld_f32x16(sc.C + 512 * t + 256 + 16 * r) * su, m);
          if (hf) st_f32x16(hf + (size_t)m * ldh + 16 * j, h);
          if (hb) st_bf16x16(hb + (size_t)m * ldh + 16 * j, h);
        }
    }
  }
}

void down_amx(const TmMatrix* W, const TmRows* h, int c0, int c1, const int32_t* out, const float* w, float* y,
              int ldy, void* scratch) {
  configure_tiles();
  const int K = W->K, M = h->M, Mt = (M + 15) / 16;
  Scratch sc = split_scratch(scratch, K);
  for (int c = c0; c < c1; c += 2) {
    const int nb = c + 1 < c1 ? 2 : 1;
    const uint16_t* b[2] = {strip_bf16(W, c, sc.b[0]), nb == 2 ? strip_bf16(W, c + 1, sc.b[1]) : nullptr};
    v16f scale[2] = {column_scale(W, c), nb == 2 ? column_scale(W, c + 1) : splat(1.0f)};
    for (int mt = 0; mt < Mt; mt += 2) {
      const int ma = mt + 1 < Mt ? 2 : 1;
      amx_any(ma, nb, h->bf16 + (size_t)16 * mt * h->ld, h->ld, b, K, W->fmt == TM_BF16, sc.C);
      for (int t = 0; t < ma; ++t)
        for (int s = 0; s < nb; ++s)
          for (int r = 0; r < 16 && 16 * (mt + t) + r < M; ++r) {
            const int m = 16 * (mt + t) + r;
            float* yr = y + (size_t)out[m] * ldy + 16 * (c - c0 + s);
            st_f32x16(yr, ld_f32x16(yr) + ld_f32x16(sc.C + 256 * (nb * t + s) + 16 * r) * scale[s] * w[m]);
          }
    }
  }
}

int wants_amx(int, int) { return TM_ROWS_BF16; }

void release_tiles(void) { _tile_release(); }

const TmKernels kTable = {TM_ISA_AMX, wants_amx, scratch_amx, up_amx, down_amx, release_tiles,
                           transposed_generic, to_bf16_generic, transpose_group_generic,
                           attend_scratch_floats, attend_task, delta_task};

}  // namespace

extern "C" const TmKernels* tm_kernels_amx(void) { return &kTable; }
