// Rotary position embedding applied in place to query and key heads: transformers' `apply_rotary_pos_emb`
// (q * cos + rotate_half(q) * sin, rotate_half(x) = cat(-x2, x1)) with its roundings. In bf16 each product and
// the sum are rounded to bf16 as torch's three elementwise ops round them (a product of two bf16 values is exact
// in fp32); in fp32 the same two products and one sum (no fused multiply-add: ISO C++ mode keeps them apart).
// GPT-OSS's form (first half * cos - second half * sin, second half * cos + first half * sin, cos / sin given once
// for both halves) is the same arithmetic with cos / sin of d / 2 values (`half_width`).
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

}  // namespace

extern "C" {

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
