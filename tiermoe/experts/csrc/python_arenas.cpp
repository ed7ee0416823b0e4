// A cache of freed blocks in front of CPython's arena allocator (tiermoe/experts/python_arenas.py says why).
// Compiled for plain x86-64; no Python headers: the allocator's struct is mirrored by PythonArenaAllocator below,
// whose layout is CPython's stable PyObjectArenaAllocator {ctx, alloc, free}.
#include <cstddef>
#include <mutex>

namespace {

struct PythonArenaAllocator {
  void* ctx;
  void* (*alloc)(void* ctx, size_t size);
  void (*free)(void* ctx, void* ptr, size_t size);
};

constexpr int kMaxBlocks = 64;

struct ArenaCache {
  PythonArenaAllocator next;  // the allocator installed before: fresh blocks come from it, evicted ones go back
  size_t max_block;           // larger blocks (pymalloc's 1 MiB arenas) pass straight through
  int capacity;
  int count = 0;
  void* blocks[kMaxBlocks];
  size_t sizes[kMaxBlocks];
  long reused = 0, fresh = 0;
  std::mutex lock;  // CPython calls the allocator with the GIL held; the lock keeps free-threaded builds safe too
};

}  // namespace

extern "C" {

void* tm_arena_cache_create(void* next_ctx, void* next_alloc, void* next_free, long max_block, int capacity) {
  auto* c = new ArenaCache;
  c->next = {next_ctx, reinterpret_cast<void* (*)(void*, size_t)>(next_alloc),
             reinterpret_cast<void (*)(void*, void*, size_t)>(next_free)};
  c->max_block = static_cast<size_t>(max_block);
  c->capacity = capacity < 0 ? 0 : (capacity > kMaxBlocks ? kMaxBlocks : capacity);
  return c;
}

void* tm_arena_cache_alloc(void* ctx, size_t size) {
  auto* c = static_cast<ArenaCache*>(ctx);
  {
    std::lock_guard<std::mutex> guard(c->lock);
    for (int i = c->count - 1; i >= 0; --i) {
      if (c->sizes[i] != size) continue;
      void* block = c->blocks[i];
      --c->count;
      c->blocks[i] = c->blocks[c->count];
      c->sizes[i] = c->sizes[c->count];
      ++c->reused;
      return block;
    }
    ++c->fresh;
  }
  return c->next.alloc(c->next.ctx, size);
}

void tm_arena_cache_free(void* ctx, void* ptr, size_t size) {
  auto* c = static_cast<ArenaCache*>(ctx);
  if (size <= c->max_block) {
    std::lock_guard<std::mutex> guard(c->lock);
    if (c->count < c->capacity) {
      c->blocks[c->count] = ptr;
      c->sizes[c->count] = size;
      ++c->count;
      return;
    }
  }
  c->next.free(c->next.ctx, ptr, size);
}

// Blocks handed out again from the cache, and blocks the allocator below had to make, since creation.
void tm_arena_cache_counts(void* ctx, long* reused, long* fresh) {
  auto* c = static_cast<ArenaCache*>(ctx);
  std::lock_guard<std::mutex> guard(c->lock);
  *reused = c->reused;
  *fresh = c->fresh;
}

}  // extern "C"
