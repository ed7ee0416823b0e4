// The fp32 vector products of LoRA adapters served per request (moe_layer.cpp, decode_layer.cpp): rank-R updates,
// a few thousand multiply-adds per row, next to products of whole weight matrices.
//
// Those units are compiled for plain x86-64 (tm_kernels.h says why), where these loops would run four lanes wide at
// best; so each function is cloned for AVX-512 and AVX2 too, and the loader picks the clone the CPU runs (GCC's
// target_clones, an ifunc per unit). Internal linkage: every including unit has its own copies, as tm_kernels.h
// requires of code built for several targets. Factors come in fp32, or bf16 (a bf16 model's), widened exactly.
#pragma once
#include <stddef.h>
#include <stdint.h>

namespace tmoe_lora {
namespace {

__attribute__((target_clones("avx512f", "avx2", "default"))) float dot(const float* a, const float* b, int n) {
  float s[16] = {};  // sixteen partial sums: one AVX-512 register, two AVX2 ones
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) s[l] += a[i + l] * b[i + l];
  float t = 0.0f;
  for (; i < n; ++i) t += a[i] * b[i];
  for (int l = 0; l < 16; ++l) t += s[l];
  return t;
}

// y[0, n) += c * v[0, n)
__attribute__((target_clones("avx512f", "avx2", "default"))) void axpy(float c, const float* __restrict v,
                                                                        float* __restrict y, int n) {
  for (int i = 0; i < n; ++i) y[i] += c * v[i];
}

inline float widen(uint16_t h) {  // bf16 -> fp32, exact
  uint32_t u = (uint32_t)h << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// The same with a's / v's values bf16 (factors held in a bf16 model's dtype), widened exactly.
__attribute__((target_clones("avx512f", "avx2", "default"))) float dot(const uint16_t* a, const float* b, int n) {
  float s[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) s[l] += widen(a[i + l]) * b[i + l];
  float t = 0.0f;
  for (; i < n; ++i) t += widen(a[i]) * b[i];
  for (int l = 0; l < 16; ++l) t += s[l];
  return t;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void axpy(float c, const uint16_t* __restrict v,
                                                                        float* __restrict y, int n) {
  for (int i = 0; i < n; ++i) y[i] += c * widen(v[i]);
}

// One row of a factor matrix stored fp32 or bf16: `row` rows of `n` values past `base`.
struct Factor {
  const void* base;
  bool bf16;
  Factor at(size_t row, size_t n) const { return {(const char*)base + row * n * (bf16 ? 2 : 4), bf16}; }
  float dot(const float* x, int n) const {
    return bf16 ? tmoe_lora::dot((const uint16_t*)base, x, n) : tmoe_lora::dot((const float*)base, x, n);
  }
  void axpy(float c, float* y, int n) const {
    if (bf16) tmoe_lora::axpy(c, (const uint16_t*)base, y, n);
    else tmoe_lora::axpy(c, (const float*)base, y, n);
  }
};

}  // namespace
}  // namespace tmoe_lora
