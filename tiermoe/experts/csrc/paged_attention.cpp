// Decode attention over the paged KV pool, read where it lies: one query token per row, its keys found through
// the row's page table, no gather and no padding.
//
// Row t attends key positions [lo[t], pos[t]] of its sequence; position k sits in pool slot
// tables[t][k / P] * P + k % P of the layer's K / V slots [S, Hkv, d]. Query head h reads KV head h / (H / Hkv).
// A key may come in two parts, [K slot | KR slot] (d + dr values), and the value may be the K slot itself: that
// is absorbed MLA (DeepSeek), whose heads all read one latent c and roped key k_pe per position, scoring
// q_latent . c + q_pe . k_pe and summing c.
// Softmax in fp32 over the scaled scores (and, with sinks, one extra logit per head that takes probability but
// adds no value: GPT-OSS). One task is one (row, KV head, range of the row's keys): the query heads of a KV head
// share every key and value row they read. Splitting the keys (flash-decoding: each range's partial softmax,
// merged after) lets a team share a few long rows, without reading any row twice (MLA's one latent serves all
// 16-128 heads). The tasks run the vector code of the ISA the caller chose (decode_attention.inc, in every ISA's
// table).
// Legend: T rows, H query heads, Hkv KV heads, d key dim, dv value dim, P page size, S slots.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

#include "dispatch.h"
#include "team.h"
#include "tm_api.h"

namespace {

struct TeamCtx {
  const TmAttnArgs* a;
  const TmKernels* k;
  tmoe::Team* team;
  float* partials;  // [tasks][tm_attn_partial_floats], with key splits
};

// One (row, KV head)'s splits merged into its query heads' outputs: each split's sums rescaled to the largest
// running max, added, divided by the added totals (a split that saw no key has max -inf and weighs nothing).
void merge_splits(const TmAttnArgs& a, const float* partials, int row_head) {
  const int splits = tm_attn_splits(a), G = a.H / a.Hkv, dv = a.dv;
  const size_t stride = tm_attn_partial_floats(a);
  const int t = row_head / a.Hkv, g = row_head % a.Hkv;
  const float* first = partials + (size_t)row_head * splits * stride;
  thread_local std::vector<float> sum;  // kept between calls, as the tasks' scratch
  sum.resize(dv);
  for (int j = 0; j < G; ++j) {
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s) m = std::fmax(m, first[s * stride + (size_t)j * (dv + 2)]);
    float total = 0.0f;
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int s = 0; s < splits; ++s) {
      const float* p = first + s * stride + (size_t)j * (dv + 2);
      if (p[0] == -INFINITY) continue;
      const float w = std::exp(p[0] - m);
      total += p[1] * w;
      for (int c = 0; c < dv; ++c) sum[c] += p[2 + c] * w;
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    const size_t o = ((size_t)t * a.H + g * G + j) * dv;
    for (int c = 0; c < dv; ++c) {
      if (a.x_bf16)
        ((uint16_t*)a.out)[o + c] = tm_f32_to_bf16(sum[c] * inv);
      else
        ((float*)a.out)[o + c] = sum[c] * inv;
    }
  }
}

// Phase 0: the tasks (each into its partial when the keys are split); phase 1: the merges.
void run_task(void* ctx, int phase, int task, int tid) {
  TeamCtx& c = *(TeamCtx*)ctx;
  if (phase == 1) return merge_splits(*c.a, c.partials, task);
  float* partial = c.partials ? c.partials + (size_t)task * tm_attn_partial_floats(*c.a) : nullptr;
  c.k->attend(c.a, task, (float*)c.team->scratch(tid).data(), partial);
}

}  // namespace

extern "C" {

// team may be null: the calling thread computes every task (a few short rows cost less than waking a team).
int tm_paged_decode_attention(void* team, const TmAttnArgs* args, char* err, int errlen) {
  const TmAttnArgs& a = *args;
  if (a.T < 0 || a.H < 1 || a.Hkv < 1 || a.H % a.Hkv != 0 || a.d < 1 || a.dv < 1 || a.page_size < 1 ||
      a.dr < 0 || a.key_splits < 0)
    return tm_fail(err, errlen, "attention shapes must be positive, with query heads a multiple of KV heads");
  if ((a.dr > 0) != (a.kr_slots != nullptr))
    return tm_fail(err, errlen, "a two-part key needs both its part's width and its slots");
  if (a.T == 0) return 0;
  const TmKernels* k = tm_table(a.isa);
  const size_t floats = k->attend_scratch_floats(args);
  const bool split = tm_attn_splits(a) > 1;
  const size_t partial_floats = split ? (size_t)tm_attn_tasks(a) * tm_attn_partial_floats(a) : 0;
  try {
    if (team == nullptr) {
      thread_local std::vector<float> scratch, partials;  // kept between calls: a decode step allocates nothing
      if (scratch.size() < floats) scratch.resize(floats);
      if (partials.size() < partial_floats) partials.resize(partial_floats);
      for (int task = 0; task < tm_attn_tasks(a); ++task)
        k->attend(args, task, scratch.data(), split ? partials.data() + task * tm_attn_partial_floats(a) : nullptr);
      for (int row_head = 0; split && row_head < a.T * a.Hkv; ++row_head) merge_splits(a, partials.data(), row_head);
      return 0;
    }
    tmoe::Team& t = *(tmoe::Team*)team;
    std::lock_guard<std::mutex> lock(t.mutex());
    for (int m = 0; m < t.size(); ++m) t.scratch(m).reserve(sizeof(float) * floats + 64);
    TeamCtx ctx{args, k, &t, split ? (float*)t.arena().reserve(sizeof(float) * partial_floats) : nullptr};
    tmoe::Job job;
    job.nphases = split ? 2 : 1;
    job.ntasks[0] = tm_attn_tasks(a);
    job.ntasks[1] = a.T * a.Hkv;
    job.run = run_task;
    job.ctx = &ctx;
    t.run(job, /*pin=*/false);
  } catch (const std::bad_alloc&) {
    return tm_fail(err, errlen, "out of memory for decode attention scratch");
  }
  return 0;
}

}  // extern "C"
