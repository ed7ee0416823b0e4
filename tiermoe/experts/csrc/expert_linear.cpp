// One packed matrix times rows of activations, both ways: what training's backward through the CPU tier needs.
//
//   tm_linear_forward:    out[M, N] = x[M, K] W^T   (raw: no activation; training adds LoRA terms before the GLU)
//   tm_linear_transposed: out[M, K] = g[M, N] W     (the input gradient of the forward product)
//   tm_heads_linear:      either, for each of H heads with a block of rows of one matrix of its own, in one job
//                         (MLA's absorbed products: each head's W_UK into its query, its W_UV onto its output)
//
// W is one expert's gate_up or down as the tier holds it (tm_kernels.h): rows and columns padded, its real rows
// in segments (gate_up: gate rows at row 0, up rows at row Ip; down: one segment). Callers pass W's real shape and
// the segment geometry and see only real rows and columns; the padding never reaches them. x / g and out are fp32
// or bf16 (out in x's dtype); accumulation is fp32. The weights are read in their packed format, never unpacked
// as a whole.
//
// Two phases on the model's thread team: 0. rows converted into what the kernels read (forward: x padded to W's
// K; transposed: g in W's packed row order, with W's row scales multiplied in where the kernels want them), 1. the
// product, split over N (forward: strips of 16 rows) or over K (transposed: groups of 32 columns), so no two tasks
// write one output. Which kernels: fp32 activations use the fp32 vector kernels (exactly dequantised weights, never
// bf16 rounding); bf16 activations the best level's, VDPBF16PS, VPDPBUSD and AMX tiles, with the many-row paths
// below (kManyRows). The forward product is each table's `down` kernel with unit weights; the transposed one is its
// `transposed` kernel, or, from kManyRows rows, the forward kernels on each group of columns transposed.
// Compiled for plain x86-64 (see tm_kernels.h). Legend: Np, Kp W's padded shape; M rows of activations.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include "dispatch.h"
#include "team.h"
#include "tm_api.h"

namespace {

constexpr int kRowsPerTask = 16;  // phase 0: rows converted per task
// bf16 activations on a CPU with VDPBF16PS, from this many rows: transposed products transpose each group of 32
// columns (int8 / int4 strips dequantised to bf16 first) for the forward kernels. Fewer rows are memory-bound: they
// keep the lane-pairing transposed kernel (bf16 weights) or the exact one (int8 / int4), which need no extra pass
// over the weights. Forward products multiply bf16 weights with VDPBF16PS and int8 / int4 weights with VPDPBUSD on
// activations quantised to int8 in blocks of 32 (int8_activations.inc), at any row count.
constexpr int kManyRows = 16;

struct Linear {
  const TmLinearArgs* a;
  const TmMatrix* W;
  const void* x;             // a's x and out, or one head's (tm_heads_linear)
  void* out;
  int64_t ldx = 0, ldo = 0;  // elements between their rows
  tmoe::Team* team;
  bool transposed;
  const TmKernels* k;
  bool via_bf16 = false;  // repack of int8 / int4 weights: their strips dequantised to bf16 first
  bool repack = false;    // transposed: each group of 32 columns transposed into T [32, kt], then k->down
  int kt = 0;             // repack: T's columns, Np rounded up to 32 (AMX tiles take 32 k)
  int wants = 0;          // row copies the kernels read (TM_ROWS_*)
  int width = 0;          // their row length: forward Kp; transposed Np (repack: kt)
  float* xf = nullptr;    // forward: x [M][width]; transposed: g [M][width] in packed row order, row scales
  uint16_t* xb = nullptr; // multiplied in (not via_bf16: those are in the strips); zero padding; the bf16 copy has
                          // rows up to a multiple of 16 (AMX reads whole tiles)
  std::vector<int32_t> ident;  // out row of each row (itself) and its weight (1), for the `down` kernels
  std::vector<float> ones;
  int chunk = 1;  // phase 1: strips (forward) or groups of 32 columns (transposed) per task
  int row_tasks = 0, product_tasks = 0;  // phases 0 and 1
  size_t f32_bytes = 0, bf16_bytes = 0;  // the row copies xf and xb
  // Member scratch: kernel scratch, the dequantised strip(s) (via_bf16), T (repack), the member's output block.
  size_t kscratch = 0, block_bytes = 0, t_bytes = 0, out_bytes = 0;
};

// Runs of W's packed rows [r0, r1) that hold real rows: f(first packed row, first real row, length) for each.
template <typename F>
inline void real_runs(const TmLinearArgs& a, int r0, int r1, F f) {
  for (int seg = r0 / a.seg_rows; seg * a.seg_rows < r1; ++seg) {
    const int lo = std::max(r0, seg * a.seg_rows), hi = std::min(r1, seg * a.seg_rows + a.seg_len);
    if (lo < hi) f(lo, seg * a.seg_len + lo - seg * a.seg_rows, hi - lo);
  }
}

// len values of the activations from element i on, times scale[] when given, into fp32 and / or bf16.
inline void load_run(const Linear& L, size_t i, int len, const float* scale, float* f32, uint16_t* bf16) {
  const bool x_bf16 = L.a->x_bf16;
  if (x_bf16 && !scale && !f32) {
    std::memcpy(bf16, (const uint16_t*)L.x + i, 2 * (size_t)len);
    return;
  }
  for (int c = 0; c < len; ++c) {
    float v = x_bf16 ? tm_bf16_to_f32(((const uint16_t*)L.x)[i + c]) : ((const float*)L.x)[i + c];
    if (scale) v *= scale[c];
    if (f32) f32[c] = v;
    if (bf16) bf16[c] = tm_f32_to_bf16(v);  // exact for unscaled bf16 activations
  }
}

// len fp32 values into the output from element i on, in the activations' dtype.
inline void store_run(const Linear& L, size_t i, int len, const float* v) {
  if (L.a->x_bf16) {
    uint16_t* dst = (uint16_t*)L.out + i;
    for (int c = 0; c < len; ++c) dst[c] = tm_f32_to_bf16(v[c]);
  } else {
    std::memcpy((float*)L.out + i, v, 4 * (size_t)len);
  }
}

void convert_rows(const Linear& L, int m0, int m1) {
  const TmLinearArgs& a = *L.a;
  const int w = L.width;
  const float* scale = L.W->fmt == TM_BF16 || L.via_bf16 ? nullptr : L.W->scale;
  for (int m = m0; m < m1; ++m) {
    float* f32 = L.wants & TM_ROWS_F32 ? L.xf + (size_t)m * w : nullptr;
    uint16_t* bf16 = L.wants & TM_ROWS_BF16 ? L.xb + (size_t)m * w : nullptr;
    if (f32) std::fill(f32, f32 + w, 0.0f);
    if (bf16) std::fill(bf16, bf16 + w, (uint16_t)0);
    if (L.transposed) {  // g's real rows go where W holds them
      real_runs(a, 0, L.W->N, [&](int r, int n, int len) {
        load_run(L, (size_t)m * L.ldx + n, len, scale ? scale + r : nullptr, f32 ? f32 + r : nullptr,
                 bf16 ? bf16 + r : nullptr);
      });
    } else {
      load_run(L, (size_t)m * L.ldx, a.K, nullptr, f32, bf16);
    }
  }
  if ((L.wants & TM_ROWS_BF16) && m1 == a.M) {
    const int mpad = (a.M + 15) & ~15;
    std::fill(L.xb + (size_t)a.M * w, L.xb + (size_t)mpad * w, (uint16_t)0);
  }
}

struct MemberScratch {
  char* kernel;
  uint16_t* block;
  uint16_t* t;
  float* out;
};

MemberScratch member_scratch(const Linear& L, int tid) {
  char* p = (char*)L.team->scratch(tid).data();
  return {p, (uint16_t*)(p + L.kscratch), (uint16_t*)(p + L.kscratch + L.block_bytes),
          (float*)(p + L.kscratch + L.block_bytes + L.t_bytes)};
}

void forward_strips(const Linear& L, int task, int tid) {
  const TmLinearArgs& a = *L.a;
  const int c0 = task * L.chunk, c1 = std::min(c0 + L.chunk, L.W->N / 16), ldy = 16 * L.chunk, Kp = L.W->K;
  const MemberScratch sc = member_scratch(L, tid);
  float* y = sc.out;
  std::fill(y, y + (size_t)a.M * ldy, 0.0f);
  TmRows rows = {L.xf, L.xb, a.M, Kp};
  L.k->down(L.W, &rows, c0, c1, L.ident.data(), L.ones.data(), y, ldy, sc.kernel);
  for (int m = 0; m < a.M; ++m)
    real_runs(a, 16 * c0, 16 * c1, [&](int r, int n, int len) {
      store_run(L, (size_t)m * L.ldo + n, len, y + (size_t)m * ldy + r - 16 * c0);
    });
}

void transposed_groups(const Linear& L, int task, int tid) {
  const TmLinearArgs& a = *L.a;
  const int g0 = task * L.chunk, g1 = std::min(g0 + L.chunk, L.W->K / 32), ldo = 32 * L.chunk;
  const int Np = L.W->N, S = Np / 16;
  const MemberScratch sc = member_scratch(L, tid);
  float* o = sc.out;
  TmRows rows = {L.xf, L.xb, a.M, L.width};
  if (L.repack) {
    std::fill(o, o + (size_t)a.M * ldo, 0.0f);
    for (int h = 0; h < 2; ++h)  // T's lines past W's rows stay zero
      std::fill(sc.t + ((size_t)h * (L.kt / 2) + Np / 2) * 32, sc.t + (size_t)(h + 1) * (L.kt / 2) * 32, (uint16_t)0);
    const TmMatrix t = {sc.t, nullptr, nullptr, nullptr, 32, L.kt, TM_BF16, 0};
    for (int g = g0; g < g1; ++g) {
      if (L.via_bf16) {
        for (int s = 0; s < S; ++s) L.k->to_bf16(L.W, s, 16 * g, 16 * g + 16, sc.block + (size_t)512 * s);
        L.k->transpose_group(sc.block, 512, S, sc.t, L.kt);
      } else {
        L.k->transpose_group((const uint16_t*)L.W->codes + (size_t)512 * g, (size_t)L.W->K * 16, S, sc.t, L.kt);
      }
      L.k->down(&t, &rows, 0, 2, L.ident.data(), L.ones.data(), o + 32 * (g - g0), ldo, sc.kernel);
    }
  } else {
    L.k->transposed(L.W, &rows, 16 * g0, 16 * g1, o, ldo);
  }
  const int k1 = std::min(32 * g1, a.K);
  if (k1 > 32 * g0)  // groups past K are W's padding
    for (int m = 0; m < a.M; ++m) store_run(L, (size_t)m * L.ldo + 32 * g0, k1 - 32 * g0, o + (size_t)m * ldo);
}

void run_task(void* ctx, int phase, int task, int tid) {
  Linear& L = *(Linear*)ctx;
  if (phase == 0) convert_rows(L, task * kRowsPerTask, std::min((task + 1) * kRowsPerTask, L.a->M));
  else if (L.transposed) transposed_groups(L, task, tid);
  else forward_strips(L, task, tid);
}

int fail(char* err, int errlen, const char* msg, long v) {
  if (err && errlen > 0) std::snprintf(err, errlen, msg, v);
  return 1;
}

int check(const TmLinearArgs& a, char* err, int errlen) {
  const TmMatrix* W = a.W;
  if (a.isa < 0 || a.isa > tm_cpu_isa())
    return fail(err, errlen, "kernel level %ld is not supported by this CPU", a.isa);
  if (!W || !W->codes || W->fmt < TM_BF16 || W->fmt > TM_INT6)
    return fail(err, errlen, "no packed matrix (format %ld)", W ? W->fmt : -1);
  if (W->N <= 0 || W->N % 16 || W->K <= 0 || W->K % (W->fmt == TM_INT4 || W->fmt == TM_INT6 ? 64 : 32))
    return fail(err, errlen, "packed matrix of %ld rows is not padded as the kernels read it", W->N);
  if (a.seg_rows <= 0 || a.seg_rows % 16 || W->N % a.seg_rows || a.seg_len <= 0 || a.seg_len > a.seg_rows ||
      (long)a.seg_len * (W->N / a.seg_rows) != a.N)
    return fail(err, errlen, "%ld real rows do not fit the packed matrix's segments", a.N);
  if (a.K <= 0 || a.K > W->K) return fail(err, errlen, "%ld columns do not fit the packed matrix", a.K);
  if (a.M < 0) return fail(err, errlen, "negative row count %ld", a.M);
  return 0;
}

// Everything a product needs but its buffers: kernels, row copies, task split and sizes. x / out and their row
// strides are a's, or one head's (tm_heads_linear).
void plan(Linear& L, tmoe::Team& team, const TmLinearArgs& a, const TmMatrix* W, bool transposed, const void* x,
          void* out, int64_t ldx, int64_t ldo) {
  const int n = team.size(), Np = W->N, Kp = W->K, M = a.M;
  L.a = &a;
  L.W = W;
  L.x = x;
  L.out = out;
  L.ldx = ldx;
  L.ldo = ldo;
  L.team = &team;
  L.transposed = transposed;
  // Which kernels: fp32 activations the fp32 vector kernels (exact); bf16 activations VDPBF16PS where the CPU has
  // it, AMX tiles for products of the forward form with amx_min_rows rows (tiles pair k like the packed strips,
  // so a transposed product becomes one by transposing its columns first: repack).
  const int vector_level = std::min(a.isa, a.x_bf16 ? (int)TM_ISA_AVX512BF16 : (int)TM_ISA_AVX512);
  const bool many = a.x_bf16 && vector_level == TM_ISA_AVX512BF16 && M >= kManyRows;
  L.repack = transposed && many;
  L.k = tm_table(a.x_bf16 && M >= a.amx_min_rows && (!transposed || L.repack) ? a.isa : vector_level);
  // (The forward kernels of AMX dequantise int8 / int4 strips themselves, int8 exactly; those of AVX512-BF16
  // quantise the activations to int8, about 20% faster on a prompt's rows than strips dequantised to bf16.)
  L.via_bf16 = L.repack && W->fmt != TM_BF16;
  L.kt = (Np + 31) & ~31;
  L.width = transposed ? (L.repack ? L.kt : Np) : Kp;
  L.wants = L.via_bf16 || L.repack ? TM_ROWS_BF16 : L.k->wants(W->fmt, M);
  L.f32_bytes = L.wants & TM_ROWS_F32 ? tm_align64(4 * (size_t)M * L.width) : 0;
  L.bf16_bytes = L.wants & TM_ROWS_BF16 ? tm_align64(2 * (size_t)((M + 15) & ~15) * L.width) : 0;
  if (transposed) {
    L.chunk = std::max(1, (Kp / 32 + 4 * n - 1) / (4 * n));
    L.kscratch = L.repack ? tm_align64(L.k->scratch_bytes(L.kt, M)) : 0;
    L.block_bytes = L.via_bf16 ? tm_align64((size_t)Np * 64) : 0;  // [Np / 16][16 pairs][16][2] bf16
    L.t_bytes = L.repack ? tm_align64((size_t)L.kt * 64) : 0;       // [2][kt / 2][16][2] bf16
    L.out_bytes = 4 * (size_t)M * 32 * L.chunk;
  } else {
    L.chunk = std::max(2, (Np / 16 + 4 * n - 1) / (4 * n));
    L.chunk += L.chunk & 1;  // the two-strip kernels
    L.kscratch = tm_align64(L.k->scratch_bytes(Kp, M));
    L.out_bytes = 4 * (size_t)M * 16 * L.chunk;
  }
  if (!transposed || L.repack) {
    L.ident.resize(M);
    for (int m = 0; m < M; ++m) L.ident[m] = m;
    L.ones.assign(M, 1.0f);
  }
  L.row_tasks = (M + kRowsPerTask - 1) / kRowsPerTask;
  L.product_tasks = transposed ? (Kp / 32 + L.chunk - 1) / L.chunk : (Np / 16 + L.chunk - 1) / L.chunk;
}

// The row copies of a planned product, at p.
void place_rows(Linear& L, char* p) {
  if (L.wants & TM_ROWS_F32) L.xf = (float*)p;
  if (L.wants & TM_ROWS_BF16) L.xb = (uint16_t*)(p + L.f32_bytes);
}

size_t member_bytes(const Linear& L) { return L.kscratch + L.block_bytes + L.t_bytes + L.out_bytes + 64; }

int linear(tmoe::Team& team, const TmLinearArgs& a, bool transposed) {
  Linear L;
  plan(L, team, a, a.W, transposed, a.x, a.out, transposed ? a.N : a.K, transposed ? a.K : a.N);
  place_rows(L, (char*)team.arena().reserve(L.f32_bytes + L.bf16_bytes + 64));
  for (int t = 0; t < team.size(); ++t) team.scratch(t).reserve(member_bytes(L));

  tmoe::Job job;
  job.nphases = 2;
  job.ntasks[0] = L.row_tasks;
  job.ntasks[1] = L.product_tasks;
  job.run = run_task;
  job.ctx = &L;
  job.at_end = L.k->finish;
  job.work = tm_product_work(*a.W, a.M);
  team.run(job, /*pin=*/false);  // any thread may call: it works as member 0 without being pinned
  return 0;
}

// Strips [s0, s0 + n) of W as a matrix of their own: every format stores its strips (codes and scales) one after
// another.
TmMatrix strips_of(const TmMatrix& W, int s0, int n) {
  const TmMatrix strip = {nullptr, nullptr, nullptr, nullptr, 16, W.K, W.fmt, 0};
  TmMatrix s = W;
  s.N = 16 * n;
  s.codes = (const char*)W.codes + tm_matrix_bytes(strip) * s0;
  if (W.scale) s.scale = W.scale + 16 * s0;
  if (W.gscale) s.gscale = W.gscale + (size_t)16 * (W.K / 32) * s0;
  if (W.gzero) s.gzero = W.gzero + (size_t)16 * (W.K / (W.fmt == TM_INT4 ? 64 : 32)) * s0;
  return s;
}

// tm_heads_linear's job: one product per head, their tasks numbered head after head in each phase.
struct Heads {
  std::vector<TmMatrix> W;
  std::vector<Linear> linear;
};

void run_head_task(void* ctx, int phase, int task, int tid) {
  Heads& h = *(Heads*)ctx;
  const int per_head = phase == 0 ? h.linear[0].row_tasks : h.linear[0].product_tasks;
  run_task(&h.linear[task / per_head], phase, task % per_head, tid);
}

int heads_linear(tmoe::Team& team, const TmHeadsArgs& a) {
  const TmLinearArgs& one = a.one;
  const size_t elem = one.x_bf16 ? 2 : 4;
  Heads h;
  h.W.reserve(a.H);  // (no reallocation: each Linear points at its matrix)
  h.linear.resize(a.H);
  size_t rows_bytes = 0, scratch = 0, work = 0;
  for (int i = 0; i < a.H; ++i) {
    h.W.push_back(strips_of(*one.W, a.first_strip + i * (one.N / 16), one.N / 16));
    plan(h.linear[i], team, one, &h.W[i], a.transposed, (const char*)one.x + elem * a.x_head * i,
         (char*)one.out + elem * a.out_head * i, a.x_row, a.out_row);
    rows_bytes += h.linear[i].f32_bytes + h.linear[i].bf16_bytes;
    scratch = std::max(scratch, member_bytes(h.linear[i]));
    work += tm_product_work(h.W[i], one.M);
  }
  char* p = (char*)team.arena().reserve(rows_bytes + 64);
  for (Linear& L : h.linear) {
    place_rows(L, p);
    p += L.f32_bytes + L.bf16_bytes;
  }
  for (int t = 0; t < team.size(); ++t) team.scratch(t).reserve(scratch);

  tmoe::Job job;
  job.nphases = 2;
  job.ntasks[0] = a.H * h.linear[0].row_tasks;
  job.ntasks[1] = a.H * h.linear[0].product_tasks;
  job.run = run_head_task;
  job.ctx = &h;
  job.at_end = h.linear[0].k->finish;
  job.work = work;
  team.run(job, /*pin=*/false);
  return 0;
}

int check_heads(const TmHeadsArgs& a, char* err, int errlen) {
  const TmLinearArgs& one = a.one;
  if (a.H <= 0) return fail(err, errlen, "%ld heads: expected at least one", a.H);
  if (one.N % 16 || one.seg_rows != one.N || one.seg_len != one.N)
    return fail(err, errlen, "a head of %ld rows is not a whole number of strips in one segment", one.N);
  if (a.first_strip < 0 || !one.W || (long)a.first_strip * 16 + (long)a.H * one.N > one.W->N)
    return fail(err, errlen, "%ld heads run past the packed matrix's rows", a.H);
  TmLinearArgs head = one;
  TmMatrix W = one.W->codes ? strips_of(*one.W, a.first_strip, one.N / 16) : *one.W;
  head.W = &W;
  return check(head, err, errlen);
}

template <typename F>
int locked(void* team, const char* what, long rows, char* err, int errlen, F f) {
  tmoe::Team& t = *(tmoe::Team*)team;
  std::lock_guard<std::mutex> lock(t.mutex());
  try {
    return f(t);
  } catch (const std::bad_alloc&) {
    return fail(err, errlen, what, rows);
  }
}

int entry(void* team, const TmLinearArgs* args, bool transposed, char* err, int errlen) {
  if (int bad = check(*args, err, errlen)) return bad;
  if (args->M == 0) return 0;
  return locked(team, "out of memory for a product of %ld rows", args->M, err, errlen,
                [&](tmoe::Team& t) { return linear(t, *args, transposed); });
}

}  // namespace

extern "C" {

int tm_linear_forward(void* team, const TmLinearArgs* args, char* err, int errlen) {
  return entry(team, args, false, err, errlen);
}

int tm_linear_transposed(void* team, const TmLinearArgs* args, char* err, int errlen) {
  return entry(team, args, true, err, errlen);
}

int tm_heads_linear(void* team, const TmHeadsArgs* args, char* err, int errlen) {
  if (int bad = check_heads(*args, err, errlen)) return bad;
  if (args->one.M == 0) return 0;
  return locked(team, "out of memory for heads' products of %ld rows", args->one.M, err, errlen,
                [&](tmoe::Team& t) { return heads_linear(t, *args); });
}

}  // extern "C"
