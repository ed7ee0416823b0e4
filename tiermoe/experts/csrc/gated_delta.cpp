// The decode step of a gated delta rule (Qwen3-Next's gated DeltaNet) over states kept in the KV pool's slots.
//
// For each row b (one token) and value head h, with q, k the row's key head kh = h / (Hv / Hk) normalised
// (x / sqrt(|x|^2 + 1e-6), q then / sqrt(dk)), S the state [dk, dv] in slot read[b]:
//   S' = exp(g) S + k (beta (v - exp(g) S^T k))^T,   out = S'^T q,   S' written to slot write[b].
// That is transformers' torch_recurrent_gated_delta_rule for one token, which gathers every row's state, makes
// about a dozen passes over it (each op a full read and write) and scatters it back; here each state is read
// where it lies and written once. Tasks are (row, value head) pairs, on the team when given.
// Legend: B rows, Hk key heads, Hv value heads, dk key dim, dv value dim.
#include <mutex>

#include "dispatch.h"
#include "team.h"

namespace {

struct DeltaCtx {
  const TmDeltaArgs* a;
  const TmKernels* k;
};

void run_delta(void* ctx, int /*phase*/, int task, int /*tid*/) {
  DeltaCtx& c = *(DeltaCtx*)ctx;
  c.k->delta(c.a, task);
}

}  // namespace

extern "C" {

// team may be null: the calling thread computes every task.
int tm_gated_delta_decode(void* team, const TmDeltaArgs* args, char* err, int errlen) {
  const TmDeltaArgs& a = *args;
  if (a.B < 0 || a.Hk < 1 || a.Hv < 1 || a.Hv % a.Hk != 0 || a.dk < 1 || a.dv < 1)
    return tm_fail(err, errlen, "gated delta shapes must be positive, with value heads a multiple of key heads");
  if (a.dk > TM_DELTA_MAX_DIM || a.dv > TM_DELTA_MAX_DIM)
    return tm_fail(err, errlen, "gated delta head dims above 512 are not supported by the native kernel");
  if (a.B == 0) return 0;
  DeltaCtx ctx{args, tm_table(a.isa)};
  if (team == nullptr) {
    for (int task = 0; task < a.B * a.Hv; ++task) ctx.k->delta(args, task);
    return 0;
  }
  tmoe::Team& t = *(tmoe::Team*)team;
  std::lock_guard<std::mutex> lock(t.mutex());
  tmoe::Job job;
  job.nphases = 1;
  job.ntasks[0] = a.B * a.Hv;
  job.run = run_delta;
  job.ctx = &ctx;
  t.run(job, /*pin=*/false);
  return 0;
}

}  // extern "C"
