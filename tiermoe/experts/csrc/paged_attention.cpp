// Decode attention over the paged KV pool, read where it lies: one query token per row, its keys found through
// the row's page table, no gather and no padding.
//
// Row t attends key positions [lo[t], pos[t]] of its sequence; position k sits in pool slot
// tables[t][k / P] * P + k % P of the layer's K / V slots [S, Hkv, d]. Query head h reads KV head h / (H / Hkv).
// A key may come in two parts, [K slot | KR slot] (d + dr values), and the value may be the K slot itself: that
// is absorbed MLA (DeepSeek), whose heads all read one latent c and roped key k_pe per position, scoring
// q_latent . c + q_pe . k_pe and summing c.
// Softmax in fp32 over the scaled scores (and, with sinks, one extra logit per head that takes probability but
// adds no value: GPT-OSS). One task is one (row, KV head, block of its query heads): the heads of a task share
// every key and value row they read; blocks of fewer heads let a team split a row of many heads (MLA: 16 to 128
// heads on one latent). The tasks run the vector code of the ISA the caller chose (decode_attention.inc, in every
// ISA's table).
// Legend: T rows, H query heads, Hkv KV heads, d key dim, dv value dim, P page size, S slots.
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
};

void run_task(void* ctx, int /*phase*/, int task, int tid) {
  TeamCtx& c = *(TeamCtx*)ctx;
  c.k->attend(c.a, task, (float*)c.team->scratch(tid).data());
}

}  // namespace

extern "C" {

// team may be null: the calling thread computes every task (a few short rows cost less than waking a team).
int tm_paged_decode_attention(void* team, const TmAttnArgs* args, char* err, int errlen) {
  const TmAttnArgs& a = *args;
  if (a.T < 0 || a.H < 1 || a.Hkv < 1 || a.H % a.Hkv != 0 || a.d < 1 || a.dv < 1 || a.page_size < 1 ||
      a.dr < 0 || a.head_block < 0)
    return tm_fail(err, errlen, "attention shapes must be positive, with query heads a multiple of KV heads");
  if ((a.dr > 0) != (a.kr_slots != nullptr))
    return tm_fail(err, errlen, "a two-part key needs both its part's width and its slots");
  if (a.T == 0) return 0;
  const TmKernels* k = tm_table(a.isa);
  const size_t floats = k->attend_scratch_floats(args);
  try {
    if (team == nullptr) {
      thread_local std::vector<float> scratch;  // kept between calls: a decode step allocates nothing
      if (scratch.size() < floats) scratch.resize(floats);
      for (int task = 0; task < tm_attn_tasks(a); ++task) k->attend(args, task, scratch.data());
      return 0;
    }
    tmoe::Team& t = *(tmoe::Team*)team;
    std::lock_guard<std::mutex> lock(t.mutex());
    for (int m = 0; m < t.size(); ++m) t.scratch(m).reserve(sizeof(float) * floats + 64);
    TeamCtx ctx{args, k, &t};
    tmoe::Job job;
    job.nphases = 1;
    job.ntasks[0] = tm_attn_tasks(a);
    job.run = run_task;
    job.ctx = &ctx;
    t.run(job, /*pin=*/false);
  } catch (const std::bad_alloc&) {
    return tm_fail(err, errlen, "out of memory for decode attention scratch");
  }
  return 0;
}

}  // extern "C"
