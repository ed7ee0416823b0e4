// A malloc family that counts, preloaded (LD_PRELOAD) into a test's child process: it sees every heap allocation of
// every thread and every library (torch's CPU allocator, the kernel library's scratch, Python's large objects),
// which no in-process hook does. Between tm_track_start and tm_track_stop it keeps
//   - the sizes of the allocations of at least `min_bytes` (the first kMaxBig of them, and how many there were),
//   - the net bytes allocated since the start (usable sizes; frees of older blocks count too) and their peak.
//   - the return addresses of each such allocation's first kFrames frames, so the test can name who asked.
// Each call forwards to glibc's own functions (__libc_*), so nothing is resolved through dlsym while it allocates.
#include <execinfo.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
#include <errno.h>

extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);
extern void __libc_free(void*);

#define kMaxBig 64
#define kFrames 12

static atomic_int on;
static size_t min_bytes;
static atomic_long net, peak, big_count;
static size_t big[kMaxBig];
static void* frames[kMaxBig][kFrames];
static __thread int unwinding;  // backtrace() may allocate: those allocations are counted, not unwound

static void counted(void* p, size_t asked) {
  if (!p || !atomic_load_explicit(&on, memory_order_relaxed)) return;
  long now = atomic_fetch_add(&net, (long)malloc_usable_size(p)) + (long)malloc_usable_size(p);
  long seen = atomic_load(&peak);
  while (now > seen && !atomic_compare_exchange_weak(&peak, &seen, now)) {
  }
  if (asked >= min_bytes) {
    long i = atomic_fetch_add(&big_count, 1);
    if (i < kMaxBig) {
      big[i] = asked;
      if (!unwinding) {
        unwinding = 1;
        backtrace(frames[i], kFrames);
        unwinding = 0;
      }
    }
  }
}

static void released(void* p) {
  if (p && atomic_load_explicit(&on, memory_order_relaxed)) atomic_fetch_sub(&net, (long)malloc_usable_size(p));
}

void* malloc(size_t n) {
  void* p = __libc_malloc(n);
  counted(p, n);
  return p;
}

void* calloc(size_t n, size_t size) {
  void* p = __libc_calloc(n, size);
  counted(p, n * size);
  return p;
}

void* realloc(void* old, size_t n) {
  released(old);
  void* p = __libc_realloc(old, n);
  counted(p ? p : (n ? old : NULL), n);  // a failed realloc keeps the old block
  return p;
}

void free(void* p) {
  released(p);
  __libc_free(p);
}

void* memalign(size_t align, size_t n) {
  void* p = __libc_memalign(align, n);
  counted(p, n);
  return p;
}

void* aligned_alloc(size_t align, size_t n) { return memalign(align, n); }

int posix_memalign(void** out, size_t align, size_t n) {
  void* p = memalign(align, n);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}

void* valloc(size_t n) { return memalign(4096, n); }

void tm_track_start(size_t min) {
  void* warm[2];
  backtrace(warm, 2);  // loads the unwinder now rather than inside an allocation
  min_bytes = min;
  atomic_store(&net, 0);
  atomic_store(&peak, 0);
  atomic_store(&big_count, 0);
  memset(big, 0, sizeof(big));
  memset(frames, 0, sizeof(frames));
  atomic_store(&on, 1);
}

void tm_track_stop(void) { atomic_store(&on, 0); }
long tm_track_peak(void) { return atomic_load(&peak); }
long tm_track_big_count(void) { return atomic_load(&big_count); }
size_t tm_track_big(int i) { return i < kMaxBig ? big[i] : 0; }
void* tm_track_frame(int i, int j) { return i < kMaxBig && j < kFrames ? frames[i][j] : NULL; }
