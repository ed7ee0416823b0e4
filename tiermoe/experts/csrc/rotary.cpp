// Rotary position embedding applied in place to query and key heads: transformers' `apply_rotary_pos_emb`
// (q * cos + rotate_half(q) * sin, rotate_half(x) = cat(-x2, x1)) with its roundings. In bf16 each product and
// the sum are rounded to bf16 as torch's three elementwise ops round them (a product of two bf16 values is exact
// in fp32); in fp32 the same two products and one sum (no fused multiply-add: ISO C++ mode keeps them apart).
// GPT-OSS's form (first half * cos - second half * sin, second half * cos + first half * sin, cos / sin given once
// for both halves) is the same arithmetic with cos / sin of d / 2 values (`half_width`).
// MLA's roped parts (tm_mla_rope) take DeepSeek's forms of it: V3's, optionally after its de-interleave (each head's
// values reordered evens, then odds, as transformers' apply_rotary_pos_emb_interleave does before the same
// arithmetic), and V2's complex rotation: each pair (a, b) of values times e^(i theta) in fp32 from a table of
// (cos theta, sin theta) pairs, as torch multiplies complex64 (ac - bd, ad + bc: each product rounded, no fused
// multiply-add), then cast to the tensor's dtype.
// Legend: T rows (tokens), H heads, d head dim (even), cos / sin [T, d] (or [T, d / 2]) in the tensor's dtype.
#include <cstdint>
#include <cstring>
#include <vector>

#include "dispatch.h"
#include "tm_api.h"

namespace {

inline float round_bf16(float f) { return tm_bf16_to_f32(tm_f32_to_bf16(f)); }

template <bool kBf16>
void rotate(void* x, int T, int H, int d, int64_t row_stride, int64_t head_stride, const void* cos, const void* sin,
            int64_t cs_row_stride, bool half_width) {
  const int half = d / 2;
  std::vector<float> v(d), c(d), s(d);
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < d; ++i) {
      const size_t at = (size_t)t * cs_row_stride + (half_width ? i % half : i);
      c[i] = kBf16 ? tm_bf16_to_f32(((const uint16_t*)cos)[at]) : ((const float*)cos)[at];
      s[i] = kBf16 ? tm_bf16_to_f32(((const uint16_t*)sin)[at]) : ((const float*)sin)[at];
    }
    for (int h = 0; h < H; ++h) {
      const size_t base = (size_t)t * row_stride + (size_t)h * head_stride;
      for (int i = 0; i < d; ++i)
        v[i] = kBf16 ? tm_bf16_to_f32(((const uint16_t*)x)[base + i]) : ((const float*)x)[base + i];
      for (int i = 0; i < d; ++i) {
        const float rot = i < half ? -v[i + half] : v[i - half];
        float out;
        if (kBf16) {
          out = round_bf16(round_bf16(v[i] * c[i]) + round_bf16(rot * s[i]));
          ((uint16_t*)x)[base + i] = tm_f32_to_bf16(out);
        } else {
          const float a = v[i] * c[i], b = rot * s[i];
          ((float*)x)[base + i] = a + b;
        }
      }
    }
  }
}

enum MlaRope { kRopeHalf = 0, kRopeInterleave = 1, kRopePairs = 2 };  // TM_MLA_ROPE_* (tm_api.h)

template <bool kBf16>
void rotate_pairs(void* x, int T, int H, int d, int64_t row_stride, int64_t head_stride, const float* cs,
                  int64_t cs_row_stride) {
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      const size_t base = (size_t)t * row_stride + (size_t)h * head_stride;
      for (int i = 0; i < d / 2; ++i) {
        const float c = cs[(size_t)t * cs_row_stride + 2 * i], s = cs[(size_t)t * cs_row_stride + 2 * i + 1];
        float a, b;
        if constexpr (kBf16) {
          a = tm_bf16_to_f32(((const uint16_t*)x)[base + 2 * i]);
          b = tm_bf16_to_f32(((const uint16_t*)x)[base + 2 * i + 1]);
        } else {
          a = ((const float*)x)[base + 2 * i];
          b = ((const float*)x)[base + 2 * i + 1];
        }
        const float ac = a * c, bs = b * s, as = a * s, bc = b * c;
        const float re = ac - bs, im = as + bc;
        if constexpr (kBf16) {
          ((uint16_t*)x)[base + 2 * i] = tm_f32_to_bf16(re);
          ((uint16_t*)x)[base + 2 * i + 1] = tm_f32_to_bf16(im);
        } else {
          ((float*)x)[base + 2 * i] = re;
          ((float*)x)[base + 2 * i + 1] = im;
        }
      }
    }
}

// Each head's d values reordered evens, then odds.
template <typename E>
void deinterleave(E* x, int T, int H, int d, int64_t row_stride, int64_t head_stride) {
  std::vector<E> v(d);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      E* head = x + (size_t)t * row_stride + (size_t)h * head_stride;
      for (int i = 0; i < d / 2; ++i) v[i] = head[2 * i], v[d / 2 + i] = head[2 * i + 1];
      std::memcpy(head, v.data(), sizeof(E) * d);
    }
}

}  // namespace

extern "C" {

// MLA's roped query or key parts in place (x as tm_rotary_inplace's), in DeepSeek's `form` (MlaRope): kRopeHalf and
// kRopeInterleave with cos / sin [T, d] in x's dtype; kRopePairs with `cos` the fp32 pairs [T, d / 2, 2] (sin unused).
int tm_mla_rope(void* x, int T, int H, int d, int64_t row_stride, int64_t head_stride, const void* cos,
                const void* sin, int64_t cs_row_stride, int form, int bf16) {
  if (T < 0 || H < 0 || d < 2 || d % 2 != 0 || form < kRopeHalf || form > kRopePairs) return 1;
  if (form == kRopePairs) {
    if (bf16)
      rotate_pairs<true>(x, T, H, d, row_stride, head_stride, (const float*)cos, cs_row_stride);
    else
      rotate_pairs<false>(x, T, H, d, row_stride, head_stride, (const float*)cos, cs_row_stride);
    return 0;
  }
  if (form == kRopeInterleave) {
    if (bf16)
      deinterleave((uint16_t*)x, T, H, d, row_stride, head_stride);
    else
      deinterleave((float*)x, T, H, d, row_stride, head_stride);
  }
  return tm_rotary_inplace(x, T, H, d, row_stride, head_stride, cos, sin, cs_row_stride, 0, bf16);
}

// x: T rows of H heads of d values (head values contiguous; strides in elements); bf16 (1) or fp32 (0).
// half_width: cos / sin hold d / 2 values per row, shared by both halves.
int tm_rotary_inplace(void* x, int T, int H, int d, int64_t row_stride, int64_t head_stride, const void* cos,
                      const void* sin, int64_t cs_row_stride, int half_width, int bf16) {
  if (T < 0 || H < 0 || d < 2 || d % 2 != 0) return 1;
  if (bf16)
    rotate<true>(x, T, H, d, row_stride, head_stride, cos, sin, cs_row_stride, half_width != 0);
  else
    rotate<false>(x, T, H, d, row_stride, head_stride, cos, sin, cs_row_stride, half_width != 0);
  return 0;
}

}  // extern "C"
