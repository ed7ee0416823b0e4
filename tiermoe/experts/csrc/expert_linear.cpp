// One packed matrix times rows of activations, both ways: what training's backward through the CPU tier needs.
//
//   tm_linear_forward:    out[M, N] = x[M, K] W^T   (raw: no activation; training adds LoRA terms before the GLU)
//   tm_linear_transposed: out[M, K] = g[M, N] W     (the input gradient of the forward product)
//
// W is one expert's gate_up or down as the tier holds it (tm_kernels.h): rows and columns padded, its real rows
// in segments (gate_up: gate rows at row 0, up rows at row Ip; down: one segment). Callers pass W's real shape and
// the segment geometry and see only real rows and columns; the padding never reaches them. x / g and out are fp32
// or bf16 (out in x's dtype); accumulation is fp32. The weights are read in their packed format, never unpacked
// as a whole.
//
// Two phases on the model's thread team: 0. rows converted into what the kernels read (forward: x padded to W's
// K; transposed: g in W's packed row order with W's row scales multiplied in), 1. the product, split over N
// (forward: strips of 16 rows) or over K (transposed: groups of 32 columns), so no two tasks write one output.
// Which kernels: fp32 activations use the fp32 vector kernels (exactly dequantised weights, never bf16 rounding);
// bf16 activations use the best level's (VDPBF16PS, and AMX tiles from amx_min_rows rows). The forward product is
// each table's `down` kernel with unit weights; the transposed one is its `transposed` kernel.
// Compiled for plain x86-64 (see tm_kernels.h). Legend: Np, Kp W's padded shape; M rows of activations.
#include <algorithm>
#include <cstdio>
#include <new>
#include <vector>

#include "dispatch.h"
#include "team.h"

extern "C" {

struct TmLinearArgs {
  int32_t isa;           // kernel level (TM_ISA_*), at most tm_cpu_isa()
  int32_t amx_min_rows;  // bf16 activations: at least this many rows use AMX tiles (isa == TM_ISA_AMX)
  int32_t M;             // rows of x / g
  int32_t N, K;          // W's real shape
  int32_t seg_rows;      // packed rows per segment of W (a multiple of 16; W->N is a whole number of segments)
  int32_t seg_len;       // real rows at the start of each segment (N = seg_len * segments)
  int32_t x_bf16;        // x / g and out are bf16 (1) or fp32 (0)
  const TmMatrix* W;
  const void* x;  // forward: [M, K]; transposed: [M, N]; rows contiguous
  void* out;      // forward: [M, N]; transposed: [M, K]; written
};

}  // extern "C"

namespace {

constexpr int kRowsPerTask = 16;  // phase 0: rows converted per task
constexpr int kViaBf16MinRows = 16;

struct Linear {
  const TmLinearArgs* a;
  const TmMatrix* W;
  tmoe::Team* team;
  bool transposed;
  const TmKernels* k;
  bool via_bf16 = false;    // int8 / int4 weights dequantised to bf16 strips for the bf16 kernels (see linear())
  int wants = 0;            // row copies the kernels read (TM_ROWS_*)
  float* xf = nullptr;      // forward: x as [M][Kp]; transposed: g as [M][Np], scaled, in packed row order
  uint16_t* xb = nullptr;   // the same in bf16 (forward: rows up to a multiple of 16, padding rows zero)
  std::vector<int32_t> ident;  // forward: out row of each row (itself)
  std::vector<float> ones;     //          and its weight (1)
  int chunk = 1;               // phase 1: strips (forward) or groups of 32 columns (transposed) per task
  size_t kscratch = 0;         // kernel scratch bytes per member, then the dequantised strips (via_bf16),
  size_t strips_bytes = 0;     // then the member's output block
};

// Where W's packed row r lands among the real rows, or -1 for a padding row.
inline int real_row(const TmLinearArgs& a, int r) {
  const int within = r % a.seg_rows;
  return within < a.seg_len ? (r / a.seg_rows) * a.seg_len + within : -1;
}

inline float in_f32(const TmLinearArgs& a, size_t i) {
  return a.x_bf16 ? tm_bf16_to_f32(((const uint16_t*)a.x)[i]) : ((const float*)a.x)[i];
}

inline void put(const TmLinearArgs& a, size_t i, float v) {
  if (a.x_bf16) ((uint16_t*)a.out)[i] = tm_f32_to_bf16(v);
  else ((float*)a.out)[i] = v;
}

void convert_rows(const Linear& L, int m0, int m1) {
  const TmLinearArgs& a = *L.a;
  const int Kp = L.W->K, Np = L.W->N;
  for (int m = m0; m < m1; ++m) {
    if (L.transposed) {  // g in packed row order, row scales multiplied in
      const float* scale = L.W->fmt == TM_BF16 || L.via_bf16 ? nullptr : L.W->scale;  // via_bf16: in the strips
      for (int r = 0; r < Np; ++r) {
        const int n = real_row(a, r);
        const float v = n < 0 ? 0.0f : in_f32(a, (size_t)m * a.N + n) * (scale ? scale[r] : 1.0f);
        if (L.wants & TM_ROWS_F32) L.xf[(size_t)m * Np + r] = v;
        if (L.wants & TM_ROWS_BF16) L.xb[(size_t)m * Np + r] = tm_f32_to_bf16(v);
      }
      continue;
    }
    if (L.wants & TM_ROWS_F32) {
      float* dst = L.xf + (size_t)m * Kp;
      for (int c = 0; c < a.K; ++c) dst[c] = in_f32(a, (size_t)m * a.K + c);
      std::fill(dst + a.K, dst + Kp, 0.0f);
    }
    if (L.wants & TM_ROWS_BF16) {
      uint16_t* dst = L.xb + (size_t)m * Kp;
      for (int c = 0; c < a.K; ++c) {
        const size_t i = (size_t)m * a.K + c;
        dst[c] = a.x_bf16 ? ((const uint16_t*)a.x)[i] : tm_f32_to_bf16(((const float*)a.x)[i]);
      }
      std::fill(dst + a.K, dst + Kp, (uint16_t)0);
    }
  }
  if (!L.transposed && (L.wants & TM_ROWS_BF16) && m1 == a.M) {  // AMX reads whole 16-row tiles
    const int mpad = (a.M + 15) & ~15;
    std::fill(L.xb + (size_t)a.M * Kp, L.xb + (size_t)mpad * Kp, (uint16_t)0);
  }
}

void forward_strips(const Linear& L, int task, int tid) {
  const TmLinearArgs& a = *L.a;
  const int c0 = task * L.chunk, c1 = std::min(c0 + L.chunk, L.W->N / 16), ldy = 16 * L.chunk, Kp = L.W->K;
  char* base = (char*)L.team->scratch(tid).data();
  float* y = (float*)(base + L.kscratch + L.strips_bytes);
  std::fill(y, y + (size_t)a.M * ldy, 0.0f);
  TmRows rows = {L.xf, L.xb, a.M, Kp};
  if (L.via_bf16) {
    uint16_t* strip = (uint16_t*)(base + L.kscratch);
    for (int c = c0; c < c1; ++c) {
      L.k->to_bf16(L.W, c, 0, Kp / 2, strip);
      const TmMatrix one = {strip, nullptr, nullptr, nullptr, 16, Kp, TM_BF16, 0};
      L.k->down(&one, &rows, 0, 1, L.ident.data(), L.ones.data(), y + 16 * (c - c0), ldy, base);
    }
  } else {
    L.k->down(L.W, &rows, c0, c1, L.ident.data(), L.ones.data(), y, ldy, base);
  }
  for (int m = 0; m < a.M; ++m)
    for (int r = 16 * c0; r < 16 * c1; ++r) {
      const int n = real_row(a, r);
      if (n >= 0) put(a, (size_t)m * a.N + n, y[(size_t)m * ldy + r - 16 * c0]);
    }
}

void transposed_groups(const Linear& L, int task, int tid) {
  const TmLinearArgs& a = *L.a;
  const int g0 = task * L.chunk, g1 = std::min(g0 + L.chunk, L.W->K / 32), ldo = 32 * L.chunk, Np = L.W->N;
  char* base = (char*)L.team->scratch(tid).data();
  float* o = (float*)(base + L.kscratch + L.strips_bytes);
  TmRows rows = {L.xf, L.xb, a.M, Np};
  if (L.via_bf16) {  // one group of 32 columns at a time, down every strip: a bf16 matrix [Np, 32]
    uint16_t* block = (uint16_t*)(base + L.kscratch);
    for (int g = g0; g < g1; ++g) {
      for (int s = 0; s < Np / 16; ++s) L.k->to_bf16(L.W, s, 16 * g, 16 * g + 16, block + (size_t)512 * s);
      const TmMatrix group = {block, nullptr, nullptr, nullptr, Np, 32, TM_BF16, 0};
      L.k->transposed(&group, &rows, 0, 16, o + 32 * (g - g0), ldo);
    }
  } else {
    L.k->transposed(L.W, &rows, 16 * g0, 16 * g1, o, ldo);
  }
  const int k1 = std::min(32 * g1, a.K);
  for (int m = 0; m < a.M; ++m)
    for (int c = 32 * g0; c < k1; ++c) put(a, (size_t)m * a.K + c, o[(size_t)m * ldo + c - 32 * g0]);
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
  if (!W || !W->codes || W->fmt < TM_BF16 || W->fmt > TM_INT4)
    return fail(err, errlen, "no packed matrix (format %ld)", W ? W->fmt : -1);
  if (W->N <= 0 || W->N % 16 || W->K <= 0 || W->K % (W->fmt == TM_INT4 ? 64 : 32))
    return fail(err, errlen, "packed matrix of %ld rows is not padded as the kernels read it", W->N);
  if (a.seg_rows <= 0 || a.seg_rows % 16 || W->N % a.seg_rows || a.seg_len <= 0 || a.seg_len > a.seg_rows ||
      (long)a.seg_len * (W->N / a.seg_rows) != a.N)
    return fail(err, errlen, "%ld real rows do not fit the packed matrix's segments", a.N);
  if (a.K <= 0 || a.K > W->K) return fail(err, errlen, "%ld columns do not fit the packed matrix", a.K);
  if (a.M < 0) return fail(err, errlen, "negative row count %ld", a.M);
  return 0;
}

int linear(tmoe::Team& team, const TmLinearArgs& a, bool transposed) {
  const TmMatrix* W = a.W;
  const int n = team.size(), Np = W->N, Kp = W->K, M = a.M;
  Linear L;
  L.a = &a;
  L.W = W;
  L.team = &team;
  L.transposed = transposed;
  const int vector_level = std::min(a.isa, a.x_bf16 ? (int)TM_ISA_AVX512BF16 : (int)TM_ISA_AVX512);
  // AMX tiles pair k like the packed strips, which suits x W^T only; g W runs on the vector kernels.
  L.k = tm_table(a.x_bf16 && M >= a.amx_min_rows && !transposed ? a.isa : vector_level);
  // bf16 activations times int8 / int4 weights where VDPBF16PS is the best kernel: from kViaBf16MinRows rows,
  // dequantising each strip once to bf16 (as `get` in bf16 rounds the weights) and running the bf16 kernels
  // beats the fp32 ones; fewer rows are memory-bound and keep the exact fp32 kernels. (AMX tiles dequantise
  // their own strips.)
  L.via_bf16 = a.x_bf16 && W->fmt != TM_BF16 && L.k->isa == TM_ISA_AVX512BF16 && M >= kViaBf16MinRows;

  // Rows the kernels read: forward x padded to Kp (bf16 copies for AMX have whole 16-row tiles), transposed g
  // in packed row order.
  L.wants = L.via_bf16 ? TM_ROWS_BF16 : L.k->wants(W->fmt, M);
  const int width = transposed ? Np : Kp;
  const size_t f32_bytes = L.wants & TM_ROWS_F32 ? tm_align64(4 * (size_t)M * width) : 0;
  const size_t bf16_bytes = L.wants & TM_ROWS_BF16 ? 2 * (size_t)(transposed ? M : (M + 15) & ~15) * width : 0;
  char* p = (char*)team.arena().reserve(f32_bytes + bf16_bytes + 64);
  if (L.wants & TM_ROWS_F32) L.xf = (float*)p;
  if (L.wants & TM_ROWS_BF16) L.xb = (uint16_t*)(p + f32_bytes);
  size_t member;
  if (transposed) {
    const int groups = Kp / 32;
    L.chunk = std::max(1, (groups + 4 * n - 1) / (4 * n));
    L.strips_bytes = L.via_bf16 ? tm_align64((size_t)Np * 64) : 0;  // [Np / 16][16 pairs][16][2] bf16
    member = L.strips_bytes + 4 * (size_t)M * 32 * L.chunk;
  } else {
    const int strips = Np / 16;
    L.chunk = std::max(2, (strips + 4 * n - 1) / (4 * n));
    L.chunk += L.chunk & 1;  // the two-strip kernels
    L.kscratch = tm_align64(L.k->scratch_bytes(Kp, M));
    L.strips_bytes = L.via_bf16 ? tm_align64((size_t)Kp * 32) : 0;  // one strip [Kp / 2][16][2] bf16
    member = L.kscratch + L.strips_bytes + 4 * (size_t)M * 16 * L.chunk;
    L.ident.resize(M);
    for (int m = 0; m < M; ++m) L.ident[m] = m;
    L.ones.assign(M, 1.0f);
  }
  for (int t = 0; t < n; ++t) team.scratch(t).reserve(member + 64);

  tmoe::Job job;
  job.nphases = 2;
  job.ntasks[0] = (M + kRowsPerTask - 1) / kRowsPerTask;
  job.ntasks[1] = transposed ? (Kp / 32 + L.chunk - 1) / L.chunk : (Np / 16 + L.chunk - 1) / L.chunk;
  job.run = run_task;
  job.ctx = &L;
  job.at_end = L.k->finish;
  team.run(job, /*pin=*/false);  // any thread may call: it works as member 0 without being pinned
  return 0;
}

int entry(void* team, const TmLinearArgs* args, bool transposed, char* err, int errlen) {
  if (int bad = check(*args, err, errlen)) return bad;
  if (args->M == 0) return 0;
  tmoe::Team& t = *(tmoe::Team*)team;
  std::lock_guard<std::mutex> lock(t.mutex());
  try {
    return linear(t, *args, transposed);
  } catch (const std::bad_alloc&) {
    return fail(err, errlen, "out of memory for a product of %ld rows", (long)args->M);
  }
}

}  // namespace

extern "C" {

int tm_linear_forward(void* team, const TmLinearArgs* args, char* err, int errlen) {
  return entry(team, args, false, err, errlen);
}

int tm_linear_transposed(void* team, const TmLinearArgs* args, char* err, int errlen) {
  return entry(team, args, true, err, errlen);
}

}  // extern "C"
