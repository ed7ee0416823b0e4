// What the plain x86-64 units (moe_layer.cpp, expert_linear.cpp) share: the kernel table of a level and the
// scalar conversions between bf16 and fp32. Never included by an ISA unit (see tm_kernels.h); static inline, so
// each including unit keeps its own copy.
#pragma once
#include <cstdio>
#include <cstring>

#include "tm_kernels.h"

static inline const TmKernels* tm_table(int isa) {
  switch (isa) {
    case TM_ISA_AMX: return tm_kernels_amx();
    case TM_ISA_AVX512BF16: return tm_kernels_avx512bf16();
    case TM_ISA_AVX512: return tm_kernels_avx512();
    case TM_ISA_AVX2: return tm_kernels_avx2();
    default: return tm_kernels_base();
  }
}

static inline float tm_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even (NaN payloads are not preserved; the kernels never make NaN).
static inline uint16_t tm_f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Writes `msg` into the caller's error buffer (may be null) and returns the entry points' failure status.
static inline int tm_fail(char* err, int errlen, const char* msg) {
  if (err && errlen > 0) std::snprintf(err, errlen, "%s", msg);
  return 1;
}

static inline size_t tm_align64(size_t n) { return (n + 63) & ~size_t(63); }

extern "C" int tm_cpu_isa(void);
