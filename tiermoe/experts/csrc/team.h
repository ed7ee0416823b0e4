// A team of pinned threads that runs one MoE layer as a few phases of tasks.
//
// The calling thread is member 0 and works too, so `n` threads means n - 1 helpers plus the caller. Tasks are
// taken from an atomic counter (dynamic balance on a shared, noisy machine) and a phase ends at a barrier: a
// layer synchronises three times, not once per small matrix. Between layers helpers spin briefly (the next layer
// usually follows within microseconds during prefill) and then sleep on a futex, so an idle team costs no CPU.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace tmoe {

constexpr int kMaxPhases = 4;

struct Job {
  int nphases = 0;
  int ntasks[kMaxPhases] = {};
  void (*run)(void* ctx, int phase, int task, int tid) = nullptr;
  void* ctx = nullptr;
  void (*at_end)(void) = nullptr;  // each member calls it after the last phase (per-thread cleanup, no ctx)
  // The job's size in bytes read (tm_product_work: weights, plus rows of compute); under the team's solo_bytes
  // the caller runs it alone.
  size_t work = SIZE_MAX;
};

// A grow-only, 64-byte aligned buffer.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  void* reserve(size_t bytes);
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

class Team {
 public:
  // cpus: one CPU per member (member 0 = the caller) to pin to, or empty for no pinning. A job whose work is under
  // solo_bytes runs on the caller alone: waking a helper that has gone to sleep (the gaps between a decode step's
  // calls outlast its spin) costs tens of microseconds, more than half of a small job takes one core.
  Team(int n, std::vector<int> cpus, int spin_us, size_t solo_bytes);
  ~Team();
  int size() const { return n_; }
  uint64_t shared_jobs() const { return shared_jobs_.load(std::memory_order_relaxed); }  // jobs helpers worked on
  // Runs every phase of `job` on all members; returns when the last phase is done. One job at a time (hold
  // mutex()). pin: pin the calling thread to member 0's CPU (the model's worker thread); other callers (training's
  // products from the autograd thread) work as member 0 where the scheduler put them, and stay unpinned.
  void run(const Job& job, bool pin = true);
  Buffer& scratch(int tid) { return *scratch_[tid]; }
  Buffer& arena() { return arena_; }
  std::mutex& mutex() { return run_mutex_; }

 private:
  void helper_main(int tid);
  void work(int tid);
  void barrier(int tid);
  void pin_caller();

  int n_;
  std::vector<int> cpus_;
  int spin_us_;
  size_t solo_bytes_;
  std::atomic<uint64_t> shared_jobs_{0};
  std::vector<std::thread> helpers_;
  std::vector<Buffer*> scratch_;
  Buffer arena_;
  std::mutex run_mutex_;
  Job job_;
  std::atomic<int> next_[kMaxPhases];
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> arrived_{0};  // never reset: barrier b of a member waits for (b + 1) * n arrivals
  std::vector<uint64_t> passed_;      // barriers each member has passed (touched only by that member)
  std::atomic<bool> stop_{false};
  std::thread::id pinned_caller_;
};

}  // namespace tmoe
