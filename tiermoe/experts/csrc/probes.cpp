// Measurements of the machine as the kernels see it, for the benchmarks' floors (benchmarks/bench_read_pace.py,
// bench_e2e_cpu.py):
//   tm_read_probe: a STREAM-style read of a buffer by the team's pinned threads, best of `reps` passes. It is the
//     rate the products' weight reads could reach at best on this team (a decode step's floor is its bytes over
//     this rate), measured with the team's own threads, pinning and task split, not torch's or another process's.
//   tm_team_empty_job: one job with a task per member and no work, every member taking part (helpers woken even
//     where a small job would run on the caller alone): timed after an idle gap, it is the team's wake-up cost.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "team.h"
#include "tm_api.h"

namespace {

constexpr size_t kChunk = 256 * 1024;  // a task's bytes: many tasks per thread, so a slow member takes fewer

struct ReadCtx {
  const uint8_t* data;
  size_t bytes;
  std::atomic<uint64_t> sink{0};  // the sums go somewhere the compiler cannot drop
};

// Eight independent accumulators of 64-bit loads: enough loads in flight to saturate memory from one core (the
// compiler vectorises the loop at the library's baseline ISA). Measured on a 2-core AMD EPYC (Zen 4): this loop read
// 17-23 GB/s where the same sum in 512-bit loads read 16-18 and in 256-bit loads with software prefetch 14-17,
// alternating in one process: wider loads or prefetching do not raise a memory-bound read.
uint64_t sum_words(const uint64_t* p, size_t n) {
  uint64_t a[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) a[j] += p[i + j];
  for (; i < n; ++i) a[0] += p[i];
  uint64_t s = 0;
  for (uint64_t v : a) s += v;
  return s;
}

void read_task(void* ctx, int, int task, int) {
  auto* c = static_cast<ReadCtx*>(ctx);
  const size_t begin = (size_t)task * kChunk;
  const size_t end = begin + kChunk < c->bytes ? begin + kChunk : c->bytes;
  const uint64_t s = sum_words(reinterpret_cast<const uint64_t*>(c->data + begin), (end - begin) / 8);
  c->sink.fetch_add(s, std::memory_order_relaxed);
}

void nothing(void*, int, int, int) {}

}  // namespace

extern "C" {

// Reads `bytes` (a multiple of 8, 8-byte aligned) at `buf` `reps` times on the team; writes the fastest pass's
// seconds to *best_seconds. Returns 0, or 1 for a bad argument.
int tm_read_probe(void* team, const void* buf, int64_t bytes, int reps, double* best_seconds) {
  if (!team || !buf || bytes <= 0 || bytes % 8 != 0 || reps < 1 || !best_seconds) return 1;
  auto* t = static_cast<tmoe::Team*>(team);
  ReadCtx ctx;
  ctx.data = static_cast<const uint8_t*>(buf);
  ctx.bytes = (size_t)bytes;
  tmoe::Job job;
  job.nphases = 1;
  job.ntasks[0] = (int)(((size_t)bytes + kChunk - 1) / kChunk);
  job.run = read_task;
  job.ctx = &ctx;  // job.work stays SIZE_MAX: every member reads
  std::lock_guard<std::mutex> hold(t->mutex());
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    t->run(job);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s < best) best = s;
  }
  *best_seconds = best;
  return 0;
}

// One job of team-size empty tasks with every member taking part; returns 0.
int tm_team_empty_job(void* team) {
  if (!team) return 1;
  auto* t = static_cast<tmoe::Team*>(team);
  tmoe::Job job;
  job.nphases = 1;
  job.ntasks[0] = t->size();
  job.run = nothing;
  std::lock_guard<std::mutex> hold(t->mutex());
  t->run(job);
  return 0;
}

}  // extern "C"
