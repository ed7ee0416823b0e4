// One MoE layer's CPU-tier experts in one call: route, gather, gate_up + activation, down + weighted sum.
//
// Phases (each a set of tasks the team shares, then a barrier):
//   0. gather: each routed expert's token rows, converted to the row formats its kernels want;
//   1. up:     h = glu(x W_gate^T + b_gate, x W_up^T + b_up) per expert (SiLU-GLU, or GPT-OSS's clamped
//              SwiGLU: TmGlu), split into tasks of 16-column blocks;
//   2. down:   y[:, cols] = sum over experts of weight * (h W_down^T + b_down)[:, cols]; a task owns a range of
//              output columns for every expert, so partial sums never race and y is written once, in x's dtype.
// With LoRA adapters served per request (tm_moe_lora_forward, TmLoraArgs) the update of gate_up lands before the
// activation, which the up kernels fuse with the product; they add it there (TmGlu's per-row addend), so:
//   0. gather, and each row's gate_up update dh = ((x A^T) * mask) B^T into the expert's buffer [M, 2Ip];
//   1. up:     as above, each row's dh added to its products before the activation;
//   2. rank:   per expert, each row's u = (h A_down^T) * mask for the down update (it needs h's whole row);
//   3. down:   as above, each pair's weight * u B_down^T added into its output columns.
// Each expert picks its kernel table by its row count: AMX tiles for many rows (prefill), vector kernels for a
// few (decode). Compiled for plain x86-64; ISA-specific code lives in the isa_*.cpp tables.
// Legend: T tokens, K top-k, D hidden (Dp padded), I intermediate (Ip padded), M rows routed to one expert.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include "dispatch.h"
#include "lora_math.h"
#include "team.h"
#include "tm_api.h"

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int kAbiVersion = 16;  // 2: tm_linear_forward / tm_linear_transposed;
                                // 3: layer_ops.cpp, paged attention, rotary;
                                // 4: decode attention per ISA (TmAttnArgs.isa);
                                // 5: the gated delta rule's decode step (TmKernels.delta);
                                // 6: a team's solo_bytes (tm_team_create), tm_team_shared_jobs
                                // 7: tm_decode_layer (decode_layer.cpp)
                                // 8: decode attention with a two-part key and key splits (TmAttnArgs)
                                // 9: TmLayerArgs' activation and per-expert biases (GPT-OSS), TmGlu
                                // 10: tm_moe_lora_forward (TmLoraArgs)
                                // 11: TmGlu's per-row addend (LoRA's gate_up update inside the up kernels)
                                // 12: probes.cpp (tm_read_probe, tm_team_empty_job)
                                // 13: TmDecodeLayerArgs.kv (k and v in a product of their own)
                                // 14: the int6 format (TM_INT6), tm_quantize_int6
                                // 15: GPT-OSS's decode layer (TmDecodeLayerArgs), tm_softmax_topk's order
                                // 16: tm_heads_linear, tm_mla_rope, tm_mla_decode

bool request_amx_permission() {
#ifdef __linux__
  // Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}

int detect_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return TM_ISA_BASE;
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
    return TM_ISA_AVX2;
  if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vnni")) return TM_ISA_AVX512;
  if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && request_amx_permission())
    return TM_ISA_AMX;
  return TM_ISA_AVX512BF16;
#else
  return TM_ISA_BASE;
#endif
}

struct ExpertWork {
  int e, m, pair0;  // expert id, rows routed to it, first of its pairs in the sorted pair arrays
  const TmKernels* k;
  TmGlu glu;  // the activation, and this expert's gate_up bias
  int wants;
  float* xf;
  uint16_t* xb;
  float* hf;
  uint16_t* hb;
  float* dh = nullptr;  // LoRA: [m][2Ip] each row's gate_up update (packed row order), the up kernels' addend
};

struct UpTask {
  int w, j0, j1;
};

struct Layer {
  const TmLayerArgs* a;
  tmoe::Team* team;
  std::vector<ExpertWork> ex;
  std::vector<int32_t> tok;  // pairs sorted by expert: token row
  std::vector<float> wt;     //                         routing weight
  std::vector<UpTask> up;
  int chunk = 1, nchunks = 0;  // down: 16-column strips per task, and tasks
  size_t kscratch = 0;         // kernel scratch bytes per member
  const TmLoraArgs* lora = nullptr;  // adapters served per request (tm_moe_lora_forward); null: none
  float* ud = nullptr;               // LoRA: [pairs][R_d] each pair's (h A_down^T) * mask
};

using tmoe_lora::Factor;

// Row t of x in fp32.
void x_row(const TmLayerArgs& a, int t, float* out) {
  if (a.x_bf16) {
    const uint16_t* src = (const uint16_t*)a.x + (size_t)t * a.D;
    for (int d = 0; d < a.D; ++d) out[d] = tm_bf16_to_f32(src[d]);
  } else {
    std::memcpy(out, (const float*)a.x + (size_t)t * a.D, sizeof(float) * a.D);
  }
}

// The rank columns a token's mask selects (its adapter's; none without one), and u = (v A^T) * mask on them:
// v [n], A [R][n]. Returns how many.
int lora_rank(Factor A, const float* mask, const float* v, int R, int n, int* cols, float* u) {
  int c = 0;
  for (int k = 0; k < R; ++k)
    if (mask[k] != 0.0f) {
      cols[c] = k;
      u[c++] = mask[k] * A.at(k, n).dot(v, n);
    }
  return c;
}

// LoRA phase 0 (after the gather): each row's gate_up update into w.dh, in the packed row order (gate rows from
// 0, up rows from Ip); rows whose token has no adapter here stay 0.
void lora_gate_up(const Layer& L, const ExpertWork& w) {
  const TmLayerArgs& a = *L.a;
  const TmLoraArgs& lo = *L.lora;
  const size_t ld = 2 * (size_t)a.Ip;
  std::memset(w.dh, 0, sizeof(float) * ld * w.m);
  if (lo.R_gu == 0) return;
  const Factor A = Factor{lo.gate_up_A, lo.factors_bf16 != 0}.at((size_t)w.e * lo.R_gu, a.D);
  const Factor Bt = Factor{lo.gate_up_Bt, lo.factors_bf16 != 0}.at((size_t)w.e * lo.R_gu, 2 * (size_t)a.I);
  std::vector<float> x(a.D), u(lo.R_gu);
  std::vector<int> cols(lo.R_gu);
  for (int r = 0; r < w.m; ++r) {
    const int t = L.tok[w.pair0 + r];
    const float* mask = lo.gate_up_mask + (size_t)t * lo.R_gu;
    bool any = false;
    for (int k = 0; k < lo.R_gu && !any; ++k) any = mask[k] != 0.0f;
    if (!any) continue;
    x_row(a, t, x.data());
    const int n = lora_rank(A, mask, x.data(), lo.R_gu, a.D, cols.data(), u.data());
    float* dh = w.dh + (size_t)r * ld;
    for (int c = 0; c < n; ++c) {
      const Factor b = Bt.at(cols[c], 2 * (size_t)a.I);
      b.axpy(u[c], dh, a.I);                     // gate
      b.at(1, a.I).axpy(u[c], dh + a.Ip, a.I);  // up: the row's second half
    }
  }
}

// LoRA phase 2's part: each pair's weight * u Bt_down for output columns [d0, d1) (y from column d0).
void lora_down(const Layer& L, int d0, int d1, float* y, int ldy) {
  const TmLoraArgs& lo = *L.lora;
  const int R = lo.R_d;
  if (R == 0) return;
  for (const ExpertWork& w : L.ex) {
    const Factor Bt = Factor{lo.down_Bt, lo.factors_bf16 != 0}.at((size_t)w.e * R, L.a->D);
    for (int r = 0; r < w.m; ++r) {
      const float* u = L.ud + (size_t)(w.pair0 + r) * R;
      float* yr = y + (size_t)L.tok[w.pair0 + r] * ldy;
      const float wt = L.wt[w.pair0 + r];
      for (int k = 0; k < R; ++k)
        if (u[k] != 0.0f) Bt.at(k, L.a->D).at(d0, 1).axpy(wt * u[k], yr, d1 - d0);  // columns [d0, d1) of row k
    }
  }
}

// LoRA phase 2: each row's down update's rank vector u into L.ud (0 without an adapter), from h as the down kernels
// read it: the bf16 copy when x is bf16 (the f32 one rounded when there is none), else the f32 copy.
void lora_down_rank(const Layer& L, const ExpertWork& w) {
  const TmLayerArgs& a = *L.a;
  const TmLoraArgs& lo = *L.lora;
  if (lo.R_d == 0) return;
  std::vector<float> h(a.I), u(lo.R_d);
  std::vector<int> cols(lo.R_d);
  const Factor A = Factor{lo.down_A, lo.factors_bf16 != 0}.at((size_t)w.e * lo.R_d, a.I);
  for (int r = 0; r < w.m; ++r) {
    const int t = L.tok[w.pair0 + r];
    float* ud = L.ud + (size_t)(w.pair0 + r) * lo.R_d;
    std::fill(ud, ud + lo.R_d, 0.0f);
    const float* mask = lo.down_mask + (size_t)t * lo.R_d;
    bool any = false;
    for (int k = 0; k < lo.R_d && !any; ++k) any = mask[k] != 0.0f;
    if (!any) continue;
    const size_t row = (size_t)r * a.Ip;
    for (int j = 0; j < a.I; ++j)
      h[j] = !a.x_bf16 ? w.hf[row + j]
             : w.hb    ? tm_bf16_to_f32(w.hb[row + j])
                       : tm_bf16_to_f32(tm_f32_to_bf16(w.hf[row + j]));
    const int n = lora_rank(A, mask, h.data(), lo.R_d, a.I, cols.data(), u.data());
    for (int c = 0; c < n; ++c) ud[cols[c]] = u[c];
  }
}

void gather(const Layer& L, const ExpertWork& w) {
  const TmLayerArgs& a = *L.a;
  const int mpad = (w.m + 15) & ~15;
  for (int r = 0; r < w.m; ++r) {
    const int t = L.tok[w.pair0 + r];
    if (w.wants & TM_ROWS_F32) {
      float* dst = w.xf + (size_t)r * a.Dp;
      if (a.x_bf16) {
        const uint16_t* src = (const uint16_t*)a.x + (size_t)t * a.D;
        for (int d = 0; d < a.D; ++d) dst[d] = tm_bf16_to_f32(src[d]);
      } else {
        std::memcpy(dst, (const float*)a.x + (size_t)t * a.D, sizeof(float) * a.D);
      }
      std::memset(dst + a.D, 0, sizeof(float) * (a.Dp - a.D));
    }
    if (w.wants & TM_ROWS_BF16) {
      uint16_t* dst = w.xb + (size_t)r * a.Dp;
      if (a.x_bf16) {
        std::memcpy(dst, (const uint16_t*)a.x + (size_t)t * a.D, 2 * (size_t)a.D);
      } else {
        const float* src = (const float*)a.x + (size_t)t * a.D;
        for (int d = 0; d < a.D; ++d) dst[d] = tm_f32_to_bf16(src[d]);
      }
      std::memset(dst + a.D, 0, 2 * (size_t)(a.Dp - a.D));
    }
  }
  if (w.wants & TM_ROWS_BF16) {  // whole tiles are read: keep the padding rows finite
    std::memset(w.xb + (size_t)w.m * a.Dp, 0, 2 * (size_t)(mpad - w.m) * a.Dp);
    std::memset(w.hb + (size_t)w.m * a.Ip, 0, 2 * (size_t)(mpad - w.m) * a.Ip);
  }
}

void down_chunk(const Layer& L, int task, int tid) {
  const TmLayerArgs& a = *L.a;
  const int c0 = task * L.chunk, c1 = std::min(c0 + L.chunk, a.Dp / 16);
  const int ldy = 16 * L.chunk;
  char* base = (char*)L.team->scratch(tid).data();
  float* y = (float*)(base + L.kscratch);
  std::memset(y, 0, sizeof(float) * (size_t)a.T * ldy);
  for (const ExpertWork& w : L.ex) {
    // down holds D rounded up to 16 rows, which can be fewer than Dp / 16 strips (int8 / int4 with D % 64 != 0)
    const int c1w = std::min(c1, a.down[w.e].N / 16);
    if (c1w <= c0) continue;
    TmRows rows = {w.hf, w.hb, w.m, a.Ip};
    w.k->down(&a.down[w.e], &rows, c0, c1w, &L.tok[w.pair0], &L.wt[w.pair0], y, ldy, base);
  }
  const int d0 = 16 * c0, d1 = std::min(16 * c1, a.D);
  if (L.lora) lora_down(L, d0, d1, y, ldy);
  if (a.down_bias)  // weight * (h W^T + b): the products are in y, each pair's weighted bias joins them
    for (const ExpertWork& w : L.ex) {
      const float* b = a.down_bias[w.e];
      if (b == nullptr) continue;
      for (int r = 0; r < w.m; ++r) {
        float* yr = y + (size_t)L.tok[w.pair0 + r] * ldy;
        const float wt = L.wt[w.pair0 + r];
        for (int d = d0; d < d1; ++d) yr[d - d0] += wt * b[d];
      }
    }
  for (int t = 0; t < a.T; ++t) {
    const float* src = y + (size_t)t * ldy;
    if (a.x_bf16) {
      uint16_t* dst = (uint16_t*)a.y + (size_t)t * a.D;
      for (int d = d0; d < d1; ++d) dst[d] = tm_f32_to_bf16(src[d - d0]);
    } else {
      float* dst = (float*)a.y + (size_t)t * a.D;
      for (int d = d0; d < d1; ++d) dst[d] = src[d - d0];
    }
  }
}

void up_task(const Layer& L, int task, int tid) {
  const UpTask& u = L.up[task];
  const ExpertWork& w = L.ex[u.w];
  TmRows rows = {w.xf, w.xb, w.m, L.a->Dp};
  w.k->up(&L.a->gate_up[w.e], &w.glu, &rows, u.j0, u.j1, w.hf, w.hb, L.a->Ip, L.team->scratch(tid).data());
}

void run_task(void* ctx, int phase, int task, int tid) {
  Layer& L = *(Layer*)ctx;
  if (phase == 0) {
    gather(L, L.ex[task]);
    if (L.lora) lora_gate_up(L, L.ex[task]);
  } else if (phase == 1) {
    up_task(L, task, tid);
  } else if (L.lora && phase == 2) {
    lora_down_rank(L, L.ex[task]);
  } else {
    down_chunk(L, task, tid);
  }
}

int fail(char* err, int errlen, const char* msg, long v) {
  if (err && errlen > 0) std::snprintf(err, errlen, msg, v);
  return 1;
}

int forward(tmoe::Team& team, const TmLayerArgs& a, const TmLoraArgs* lora, char* err, int errlen) {
  Layer L;
  L.a = &a;
  L.team = &team;
  L.lora = lora;
  const int n = team.size();

  // Route: count pairs per expert, then sort them by expert (counting sort keeps token order within an expert).
  std::vector<int> count(a.n_experts + 1, 0);
  for (long i = 0; i < (long)a.T * a.K; ++i) {
    const int64_t e = a.ids[i];
    if (e < 0) continue;
    if (e >= a.n_experts || a.gate_up[e].codes == nullptr)
      return fail(err, errlen, "expert %ld was routed to the CPU tier, which does not hold it", (long)e);
    ++count[e + 1];
  }
  std::vector<int> start(a.n_experts + 1, 0);
  for (int e = 0; e < a.n_experts; ++e) start[e + 1] = start[e] + count[e + 1];
  L.tok.resize(start[a.n_experts]);
  L.wt.resize(start[a.n_experts]);
  {
    std::vector<int> fill(start.begin(), start.end() - 1);
    for (long i = 0; i < (long)a.T * a.K; ++i) {
      const int64_t e = a.ids[i];
      if (e < 0) continue;
      L.tok[fill[e]] = (int32_t)(i / a.K);
      L.wt[fill[e]++] = a.weights[i];
    }
  }

  // Kernels and buffers per routed expert; the busiest experts first, so the last tasks are the short ones.
  // fp32 activations keep int8 / int4 weights on the exact kernels (the AVX512-BF16 level quantises activations
  // to int8 for them: int8_activations.inc); bf16 weights multiply bf16-rounded activations on every level.
  const TmKernels* vec = tm_table(std::min(a.isa, (int)TM_ISA_AVX512BF16));
  const TmKernels* exact = tm_table(std::min(a.isa, (int)TM_ISA_AVX512));
  const TmKernels* amx = a.isa >= TM_ISA_AMX ? tm_table(TM_ISA_AMX) : nullptr;
  for (int e = 0; e < a.n_experts; ++e)
    if (count[e + 1] > 0) {
      const int m = count[e + 1];
      const TmKernels* k = amx && m >= a.amx_min_rows            ? amx
                           : a.x_bf16 || a.gate_up[e].fmt == TM_BF16 ? vec
                                                                      : exact;
      const TmGlu glu = {a.act, a.alpha, a.limit, a.gate_up_bias ? a.gate_up_bias[e] : nullptr};
      // gate_up and down may be held in different formats (int4 with int6 downs): the copies both want
      const int wants = k->wants(a.gate_up[e].fmt, m) | k->wants(a.down[e].fmt, m);
      L.ex.push_back({e, m, start[e], k, glu, wants, nullptr, nullptr, nullptr, nullptr});
    }
  std::stable_sort(L.ex.begin(), L.ex.end(), [](const ExpertWork& x, const ExpertWork& y) { return x.m > y.m; });

  // LoRA's down update reads h in fp32 when x is fp32 (lora_down_rank): the f32 copy is kept then, whatever the
  // down kernels read
  const bool keep_hf = lora && !a.x_bf16;
  size_t arena = lora ? tm_align64(4 * L.tok.size() * (size_t)lora->R_d) : 0;
  for (ExpertWork& w : L.ex) {
    const size_t mpad = (w.m + 15) & ~15;
    if (w.wants & TM_ROWS_F32) arena += tm_align64(4 * (size_t)w.m * a.Dp);
    if ((w.wants & TM_ROWS_F32) || keep_hf) arena += tm_align64(4 * (size_t)w.m * a.Ip);
    if (w.wants & TM_ROWS_BF16) arena += tm_align64(2 * mpad * a.Dp) + tm_align64(2 * mpad * a.Ip);
    if (lora) arena += tm_align64(8 * (size_t)w.m * a.Ip);
    L.kscratch = std::max(L.kscratch, std::max(w.k->scratch_bytes(a.Dp, w.m), w.k->scratch_bytes(a.Ip, w.m)));
  }
  L.kscratch = tm_align64(L.kscratch);
  char* p = (char*)team.arena().reserve(arena + 64);
  for (ExpertWork& w : L.ex) {
    const size_t mpad = (w.m + 15) & ~15;
    auto take = [&p](size_t bytes) { char* q = p; p += tm_align64(bytes); return q; };
    if (w.wants & TM_ROWS_F32) w.xf = (float*)take(4 * (size_t)w.m * a.Dp);
    if ((w.wants & TM_ROWS_F32) || keep_hf) w.hf = (float*)take(4 * (size_t)w.m * a.Ip);
    if (w.wants & TM_ROWS_BF16) {
      w.xb = (uint16_t*)take(2 * mpad * a.Dp);
      w.hb = (uint16_t*)take(2 * mpad * a.Ip);
    }
    if (lora) {
      w.dh = (float*)take(8 * (size_t)w.m * a.Ip);
      w.glu.add = w.dh;
      w.glu.add_ld = 2 * a.Ip;
    }
  }
  if (lora) L.ud = (float*)p;

  // Phase 1 tasks: blocks of 16 intermediate columns, split so there are a few tasks per member.
  const int blocks = a.Ip / 16;
  const long total = (long)blocks * L.ex.size();
  const long target = std::max<long>(8L * n, (long)L.ex.size());
  const int per_task = (int)std::max<long>(1, std::min<long>(blocks, (total + target - 1) / std::max<long>(target, 1)));
  for (int w = 0; w < (int)L.ex.size(); ++w)
    for (int j = 0; j < blocks; j += per_task) L.up.push_back({w, j, std::min(j + per_task, blocks)});

  // Phase 2 tasks: ranges of output strips (an even count, for the two-strip kernels). Each task reads every
  // routed expert's h, so fewer, wider tasks re-read less of it; 4 per member still balance.
  const int strips = a.Dp / 16;
  L.chunk = std::max(2, (strips + 4 * n - 1) / (4 * n));
  L.chunk += L.chunk & 1;
  L.nchunks = (strips + L.chunk - 1) / L.chunk;
  const size_t member = L.kscratch + 4 * (size_t)a.T * 16 * L.chunk;
  for (int t = 0; t < n; ++t) team.scratch(t).reserve(member);

  tmoe::Job job;
  job.nphases = lora ? 4 : 3;
  job.ntasks[0] = (int)L.ex.size();
  job.ntasks[1] = (int)L.up.size();
  if (lora) job.ntasks[2] = lora->R_d ? (int)L.ex.size() : 0;
  job.ntasks[job.nphases - 1] = L.nchunks;
  job.run = run_task;
  job.ctx = &L;
  job.at_end = (amx ? amx : vec)->finish;
  job.work = 0;
  for (const ExpertWork& w : L.ex) job.work += tm_product_work(a.gate_up[w.e], w.m) + tm_product_work(a.down[w.e], w.m);
  team.run(job);
  return 0;
}

}  // namespace

extern "C" {

int tm_abi_version(void) { return kAbiVersion; }

int tm_cpu_isa(void) {
  static const int isa = detect_isa();  // immutable once computed: the CPU does not change under us
  return isa;
}

void* tm_team_create(int n, const int* cpus, int ncpus, int spin_us, long solo_bytes) {
  try {
    return new tmoe::Team(n, std::vector<int>(cpus, cpus + (cpus ? ncpus : 0)), spin_us,
                          solo_bytes < 0 ? 0 : (size_t)solo_bytes);
  } catch (...) {
    return nullptr;
  }
}

void tm_team_destroy(void* team) { delete (tmoe::Team*)team; }

int tm_team_size(void* team) { return ((tmoe::Team*)team)->size(); }

long tm_team_shared_jobs(void* team) { return (long)((tmoe::Team*)team)->shared_jobs(); }

int tm_moe_forward(void* team, const TmLayerArgs* args, char* err, int errlen) {
  return tm_moe_lora_forward(team, args, nullptr, err, errlen);
}

int tm_moe_lora_forward(void* team, const TmLayerArgs* args, const TmLoraArgs* lora, char* err, int errlen) {
  if (lora && (lora->R_gu < 0 || lora->R_d < 0 || (lora->R_gu && !(lora->gate_up_A && lora->gate_up_Bt &&
                                                                  lora->gate_up_mask)) ||
               (lora->R_d && !(lora->down_A && lora->down_Bt && lora->down_mask))))
    return fail(err, errlen, "LoRA factors of %ld rank columns are missing", (long)(lora->R_gu + lora->R_d));
  if (args->isa > tm_cpu_isa())
    return fail(err, errlen, "kernel level %ld is above what this CPU supports", (long)args->isa);
  if (args->act != TM_ACT_SILU_GLU && args->act != TM_ACT_GPT_OSS_GLU)
    return fail(err, errlen, "unknown expert activation %ld (0: SiLU-GLU, 1: GPT-OSS's clamped SwiGLU)",
                (long)args->act);
  tmoe::Team& t = *(tmoe::Team*)team;
  std::lock_guard<std::mutex> lock(t.mutex());
  try {
    return forward(t, *args, lora, err, errlen);
  } catch (const std::bad_alloc&) {
    return fail(err, errlen, "out of memory for a layer of %ld tokens", (long)args->T);
  }
}

}  // extern "C"
