// Decode attention over the paged KV pool, read where it lies: one query token per row, its keys found through
// the row's page table, no gather and no padding.
//
// Row t attends key positions [lo[t], pos[t]] of its sequence; position k sits in pool slot
// tables[t][k / P] * P + k % P of the layer's K / V slots [S, Hkv, d]. Query head h reads KV head h / (H / Hkv).
// Softmax in fp32 over the scaled scores (and, with sinks, one extra logit per head that takes probability but
// adds no value: GPT-OSS). Keys are taken in blocks: scores of a block, then one rescale of the running sums.
// One task is one (row, KV head): its query heads share every key and value row they read.
// Legend: T rows, H query heads, Hkv KV heads, d key dim, dv value dim, P page size, S slots.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

#include "dispatch.h"
#include "team.h"

extern "C" {

struct TmAttnArgs {
  int32_t T, H, Hkv, d, dv;
  int32_t page_size, max_pages;
  int32_t x_bf16;                    // q, K/V slots and out are bf16 (1) or fp32 (0)
  int64_t q_row_stride, q_head_stride;  // elements; each head's d values are contiguous
  float scale;
  const void* q;
  const void* k_slots;  // [S, Hkv, d]
  const void* v_slots;  // [S, Hkv, dv]
  const float* sinks;   // [H] or null
  const int64_t* tables;  // [T, max_pages] page ids
  const int32_t* pos;     // [T] the row's query position (its last visible key)
  const int32_t* lo;      // [T] its first visible key position
  void* out;              // [T, H, dv], contiguous
};

}  // extern "C"

namespace {

constexpr int kBlock = 32;  // keys scored before the running sums are rescaled once

typedef float v8f __attribute__((vector_size(32)));

// A row of n values as fp32 into dst.
inline void to_f32(const void* src, size_t offset, int n, bool bf16, float* dst) {
  if (bf16) {
    const uint16_t* s = (const uint16_t*)src + offset;
    for (int i = 0; i < n; ++i) dst[i] = tm_bf16_to_f32(s[i]);
  } else {
    std::memcpy(dst, (const float*)src + offset, sizeof(float) * n);
  }
}

inline float dot(const float* a, const float* b, int n) {
  v8f acc = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    v8f x, y;
    std::memcpy(&x, a + i, 32);
    std::memcpy(&y, b + i, 32);
    acc += x * y;
  }
  float s = 0.f;
  for (int l = 0; l < 8; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

struct Attn {
  const TmAttnArgs* a;
  int group;  // query heads per KV head
};

// Per-task scratch: queries [G][d], sums [G][dv], running max / total [G], scores [G][kBlock], one K and V row.
size_t scratch_floats(const TmAttnArgs& a, int group) {
  return (size_t)group * (a.d + a.dv + 2 + kBlock) + (size_t)kBlock * (a.d + a.dv);
}

void attend(const Attn& A, int task, float* scratch) {
  const TmAttnArgs& a = *A.a;
  const int G = A.group, d = a.d, dv = a.dv, P = a.page_size;
  const int t = task / a.Hkv, g = task % a.Hkv;
  const bool bf16 = a.x_bf16 != 0;
  float* q = scratch;                   // [G][d]
  float* acc = q + (size_t)G * d;       // [G][dv]
  float* mx = acc + (size_t)G * dv;     // [G]
  float* total = mx + G;                // [G]
  float* score = total + G;             // [G][kBlock]
  float* keys = score + (size_t)G * kBlock;  // [kBlock][d]
  float* vals = keys + (size_t)kBlock * d;   // [kBlock][dv]
  for (int j = 0; j < G; ++j) {
    const int h = g * G + j;
    to_f32(a.q, (size_t)t * a.q_row_stride + (size_t)h * a.q_head_stride, d, bf16, q + (size_t)j * d);
    mx[j] = a.sinks ? a.sinks[h] : -INFINITY;
    total[j] = a.sinks ? 1.f : 0.f;
  }
  std::memset(acc, 0, sizeof(float) * G * dv);
  const int64_t* table = a.tables + (size_t)t * a.max_pages;
  const int first = a.lo[t], last = a.pos[t];
  for (int k0 = first; k0 <= last; k0 += kBlock) {
    const int n = std::min(kBlock, last + 1 - k0);
    for (int i = 0; i < n; ++i) {
      const int k = k0 + i;
      const size_t slot = (size_t)table[k / P] * P + k % P;
      to_f32(a.k_slots, (slot * a.Hkv + g) * d, d, bf16, keys + (size_t)i * d);
      to_f32(a.v_slots, (slot * a.Hkv + g) * dv, dv, bf16, vals + (size_t)i * dv);
    }
    for (int j = 0; j < G; ++j) {
      float* s = score + (size_t)j * kBlock;
      float block_max = -INFINITY;
      for (int i = 0; i < n; ++i) {
        s[i] = dot(q + (size_t)j * d, keys + (size_t)i * d, d) * a.scale;
        block_max = std::max(block_max, s[i]);
      }
      const float m = std::max(mx[j], block_max);
      const float keep = mx[j] == -INFINITY ? 0.f : std::exp(mx[j] - m);
      float* y = acc + (size_t)j * dv;
      float sum = total[j] * keep;
      if (keep != 1.f)
        for (int c = 0; c < dv; ++c) y[c] *= keep;
      for (int i = 0; i < n; ++i) {
        const float p = std::exp(s[i] - m);
        sum += p;
        axpy(y, p, vals + (size_t)i * dv, dv);
      }
      mx[j] = m;
      total[j] = sum;
    }
  }
  for (int j = 0; j < G; ++j) {
    const int h = g * G + j;
    const float inv = total[j] > 0.f ? 1.f / total[j] : 0.f;
    const size_t o = ((size_t)t * a.H + h) * dv;
    for (int c = 0; c < dv; ++c) {
      const float v = acc[(size_t)j * dv + c] * inv;
      if (bf16)
        ((uint16_t*)a.out)[o + c] = tm_f32_to_bf16(v);
      else
        ((float*)a.out)[o + c] = v;
    }
  }
}

struct TeamCtx {
  const Attn* A;
  tmoe::Team* team;
  size_t floats;
};

void run_task(void* ctx, int /*phase*/, int task, int tid) {
  TeamCtx& c = *(TeamCtx*)ctx;
  attend(*c.A, task, (float*)c.team->scratch(tid).data());
}

int fail(char* err, int errlen, const char* msg) {
  if (err && errlen > 0) std::snprintf(err, errlen, "%s", msg);
  return 1;
}

}  // namespace

extern "C" {

// team may be null: the calling thread computes every task (a few short rows cost less than waking a team).
int tm_paged_decode_attention(void* team, const TmAttnArgs* args, char* err, int errlen) {
  const TmAttnArgs& a = *args;
  if (a.T < 0 || a.H < 1 || a.Hkv < 1 || a.H % a.Hkv != 0 || a.d < 1 || a.dv < 1 || a.page_size < 1)
    return fail(err, errlen, "attention shapes must be positive, with query heads a multiple of KV heads");
  if (a.T == 0) return 0;
  Attn A{args, a.H / a.Hkv};
  const size_t floats = scratch_floats(a, A.group);
  try {
    if (team == nullptr) {
      std::vector<float> scratch(floats);
      for (int task = 0; task < a.T * a.Hkv; ++task) attend(A, task, scratch.data());
      return 0;
    }
    tmoe::Team& t = *(tmoe::Team*)team;
    std::lock_guard<std::mutex> lock(t.mutex());
    for (int m = 0; m < t.size(); ++m) t.scratch(m).reserve(sizeof(float) * floats + 64);
    TeamCtx ctx{&A, &t, floats};
    tmoe::Job job;
    job.nphases = 1;
    job.ntasks[0] = a.T * a.Hkv;
    job.run = run_task;
    job.ctx = &ctx;
    t.run(job, /*pin=*/false);
  } catch (const std::bad_alloc&) {
    return fail(err, errlen, "out of memory for decode attention scratch");
  }
  return 0;
}

}  // extern "C"
