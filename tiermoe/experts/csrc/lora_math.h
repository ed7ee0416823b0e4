// The fp32 vector products of LoRA adapters served per request (moe_layer.cpp, decode_layer.cpp): rank-R updates,
// a few thousand multiply-adds per row, next to products of whole weight matrices.
//
// Those units are compiled for plain x86-64 (tm_kernels.h says why), where these loops would run four lanes wide at
// best; so each function is cloned for AVX-512 and AVX2 too, and the loader picks the clone the CPU runs (GCC's
// target_clones, an ifunc per unit). Internal linkage: every including unit has its own copies, as tm_kernels.h
// requires of code built for several targets.
#pragma once

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

}  // namespace
}  // namespace tmoe_lora
