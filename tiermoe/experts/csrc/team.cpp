// The thread team (see team.h). Compiled for plain x86-64: no ISA-specific code here.
#include "team.h"

#include <chrono>
#include <cstdlib>
#include <new>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

namespace tmoe {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

void pin_current_thread(int cpu) {
#ifdef __linux__
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: a failure only costs locality
#else
  (void)cpu;
#endif
}

}  // namespace

Buffer::~Buffer() { std::free(data_); }

void* Buffer::reserve(size_t bytes) {
  if (bytes <= size_) return data_;
  std::free(data_);
  size_t rounded = (bytes + 4095) & ~size_t(4095);
  data_ = std::aligned_alloc(64, rounded);
  if (!data_) {
    size_ = 0;
    throw std::bad_alloc();
  }
  size_ = rounded;
  return data_;
}

Team::Team(int n, std::vector<int> cpus, int spin_us, size_t solo_bytes)
    : n_(n < 1 ? 1 : n), cpus_(std::move(cpus)), spin_us_(spin_us), solo_bytes_(solo_bytes), passed_(n_, 0) {
  for (auto& c : next_) c.store(0);
  for (int t = 0; t < n_; ++t) scratch_.push_back(new Buffer());
  for (int t = 1; t < n_; ++t) helpers_.emplace_back(&Team::helper_main, this, t);
}

Team::~Team() {
  stop_.store(true);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (auto& h : helpers_) h.join();
  for (auto* b : scratch_) delete b;
}

void Team::pin_caller() {
  // The caller is usually tiermoe's one CPU-worker thread, pinned on its first job; another thread calling
  // later (a benchmark, a test) is pinned when it first calls.
  if (cpus_.empty() || pinned_caller_ == std::this_thread::get_id()) return;
  pin_current_thread(cpus_[0]);
  pinned_caller_ = std::this_thread::get_id();
}

void Team::run(const Job& job, bool pin) {
  if (pin) pin_caller();
  if (n_ == 1 || job.work < solo_bytes_) {  // no helper woken, no barrier: phases in order on this thread
    for (int p = 0; p < job.nphases; ++p)
      for (int t = 0; t < job.ntasks[p]; ++t) job.run(job.ctx, p, t, 0);
    if (job.at_end) job.at_end();
    return;
  }
  shared_jobs_.fetch_add(1, std::memory_order_relaxed);
  job_ = job;
  for (int p = 0; p < kMaxPhases; ++p) next_[p].store(0, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  if (n_ > 1) generation_.notify_all();
  work(0);
}

void Team::barrier(int tid) {
  const uint64_t target = (passed_[tid] + 1) * (uint64_t)n_;
  arrived_.fetch_add(1, std::memory_order_acq_rel);
  for (int spins = 0; arrived_.load(std::memory_order_acquire) < target; ++spins) {
    cpu_relax();
    if (spins > 4096) std::this_thread::yield();  // a member was descheduled: give its core back
  }
  ++passed_[tid];
}

void Team::work(int tid) {
  // A copy: after its last barrier a member must not read job_, which the caller may already be refilling.
  const Job job = job_;
  for (int p = 0; p < job.nphases; ++p) {
    for (int t; (t = next_[p].fetch_add(1, std::memory_order_relaxed)) < job.ntasks[p];) job.run(job.ctx, p, t, tid);
    barrier(tid);
  }
  if (job.at_end) job.at_end();
}

void Team::helper_main(int tid) {
  if (!cpus_.empty()) pin_current_thread(cpus_[tid]);
  uint64_t seen = 0;
  for (;;) {
    uint64_t g = generation_.load(std::memory_order_acquire);
    if (g == seen) {
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      for (int i = 0; (g = generation_.load(std::memory_order_acquire)) == seen; ++i) {
        cpu_relax();
        if ((i & 63) == 0 && std::chrono::steady_clock::now() > until) {
          generation_.wait(seen, std::memory_order_acquire);
        }
      }
    }
    seen = g;
    if (stop_.load()) return;
    work(tid);
  }
}

}  // namespace tmoe
