// Shared declarations of tiermoe's CPU expert kernels: packed weight formats and the per-ISA kernel table.
//
// Every ISA-specific translation unit includes only this header, <immintrin.h> and C headers, keeps all its
// functions in an anonymous namespace (internal linkage), and exports one table getter with a unique name.
// That matters: an inline function with external linkage compiled under `#pragma GCC target("avx512f")` in one
// unit could be the copy the linker keeps for every unit, and would then run AVX-512 code on an AVX2 CPU.
//
// Legend: N output rows of a matrix, K its input columns (padded: N % 16 == 0, K % 64 == 0), M rows of
// activations (tokens routed to one expert), I intermediate size (padded), D hidden size (padded).
#pragma once
#include <stddef.h>
#include <stdint.h>

enum TmFormat { TM_BF16 = 0, TM_INT8 = 1, TM_INT4 = 2, TM_INT6 = 3 };
enum TmIsa { TM_ISA_BASE = 0, TM_ISA_AVX2 = 1, TM_ISA_AVX512 = 2, TM_ISA_AVX512BF16 = 3, TM_ISA_AMX = 4 };
enum { TM_ROWS_F32 = 1, TM_ROWS_BF16 = 2 };

// One packed weight matrix W [N, K]. Rows are grouped in strips of 16; within a strip, consecutive k pairs:
//   bf16: uint16 codes [N/16][K/2][16][2]   (the AMX B-tile / VNNI layout: one 64-byte line = 16 rows x 2 k)
//   int8: int8 codes   [N/16][K/2][16][2],  w = code * scale[n]
//   int4: uint8 codes  [N/16][K/8][16][4]: chunks of 4 lines, byte 4r + i holding row r's line i (the order
//         VPDPBUSD reads a row's 4 bytes in one lane), low nibble k even, high nibble k odd;
//         gscale uint8 [N/16][K/32][16], gzero uint8 [N/16][K/64][16] (low nibble group 2j, high 2j+1),
//         w = scale[n] * gscale * (code - zero)
//   int6: per strip, groups of 32 k of 384 bytes: the group's 16 lines of low nibbles as int4's (256 bytes), then
//         its high 2 bits in two 64-byte blocks, block h for the group's lines 8h .. 8h + 7: byte 4r + i holds
//         row r's line 8h + i (low nibble) and line 8h + 4 + i (high nibble), each nibble k even in bits 0-1 and
//         k odd in bits 2-3 (what lets the VNNI kernel OR them into a load of 4 lines as it stands);
//         gscale uint8 [N/16][K/32][16], gzero uint8 [N/16][K/32][16] (0..63), w = scale[n] * gscale * (code - zero)
struct TmMatrix {
  const void* codes;
  const float* scale;
  const uint8_t* gscale;
  const uint8_t* gzero;
  int32_t N, K, fmt, _pad;
};

// The bytes of a matrix's codes (its scales add a few percent): what a product with it reads.
inline size_t tm_matrix_bytes(const TmMatrix& W) {
  return (size_t)W.N * W.K * (W.fmt == TM_BF16 ? 16 : W.fmt == TM_INT8 ? 8 : W.fmt == TM_INT6 ? 6 : 4) / 8;
}

// A product's work for a team's solo test (team.h), in bytes read: the matrix once, and each further row of
// activations an eighth of it again (computed from cache: measured, 8 rows cost about twice one).
inline size_t tm_product_work(const TmMatrix& W, int rows) { return tm_matrix_bytes(W) * (7 + (size_t)rows) / 8; }

// M rows of activations with row stride ld (elements): an fp32 copy and/or a bf16 copy (whichever the kernel
// table asked for). The bf16 copy has rows allocated up to a multiple of 16 (AMX tiles read whole tiles).
struct TmRows {
  const float* f32;
  const uint16_t* bf16;
  int32_t M, ld;
};

// How an up kernel turns an expert's gate and up products (row scales applied) into h, the down product's input.
// The bias is added first, as transformers' linear adds it before the activation, then the row's addend (LoRA
// served per request: each row's own gate_up update, csrc/moe_layer.cpp):
//   TM_ACT_SILU_GLU:    h = silu(gate) * up
//   TM_ACT_GPT_OSS_GLU: gate = min(gate, limit), up = clamp(up, -limit, limit),
//                       h = (up + 1) * gate * sigmoid(alpha * gate)          (GPT-OSS's clamped SwiGLU)
enum TmActivation { TM_ACT_SILU_GLU = 0, TM_ACT_GPT_OSS_GLU = 1 };
struct TmGlu {
  int32_t act;         // TM_ACT_*
  float alpha, limit;  // TM_ACT_GPT_OSS_GLU only
  const float* bias;   // [W->N] fp32 in W's packed row order (gate rows, then up rows; padding rows 0), or null
  const float* add;    // [M][add_ld] fp32 per row of the call's x, in the same packed order, or null
  int32_t add_ld;
};

// Decode rows attending the paged KV pool in place (paged_attention.cpp has the semantics). One task is one row, one
// KV head (the query heads that share it) and one of `key_splits` contiguous ranges of the row's keys: task =
// (t * Hkv + g) * splits + sp. With more than one split each task leaves a partial softmax (running max, total,
// unnormalised sum per head) that a second pass merges (flash-decoding): a few long rows can then keep a team busy.
struct TmAttnArgs {
  int32_t isa;  // the kernel table that computes the tasks
  int32_t T, H, Hkv, d, dv;
  int32_t page_size, max_pages;
  int32_t x_bf16;                       // q, K/V slots and out are bf16 (1) or fp32 (0)
  int32_t dr;                           // a key's second part (0: none): MLA's roped key beside its latent
  int64_t q_row_stride, q_head_stride;  // elements; each head's d + dr values are contiguous
  float scale;
  int32_t key_splits;     // ranges each row's keys are split into (0 or 1: none)
  const void* q;
  const void* k_slots;    // [S, Hkv, d]
  const void* kr_slots;   // [S, Hkv, dr], the key's last dr values (null when dr is 0)
  const void* v_slots;    // [S, Hkv, dv] (may be k_slots itself: MLA's value is its latent)
  const float* sinks;     // [H] or null
  const int64_t* tables;  // [T, max_pages] page ids
  const int32_t* pos;     // [T] the row's query position (its last visible key)
  const int32_t* lo;      // [T] its first visible key position
  void* out;              // [T, H, dv], contiguous
};

// Key splits, and tasks, of a decode attention call (TmAttnArgs' task numbering); a split's partial result per
// query head: running max, total and dv sums. Static: every ISA unit's copy stays its own (see the top of this
// file).
static inline int tm_attn_splits(const TmAttnArgs& a) { return a.key_splits > 1 ? a.key_splits : 1; }
static inline int tm_attn_tasks(const TmAttnArgs& a) { return a.T * a.Hkv * tm_attn_splits(a); }
static inline size_t tm_attn_partial_floats(const TmAttnArgs& a) { return (size_t)(a.H / a.Hkv) * (a.dv + 2); }

enum { TM_DELTA_MAX_DIM = 512 };  // the gated delta rule's largest key / value head dim (per-task arrays)

// Decode rows of a gated delta rule (Qwen3-Next's linear attention) updating their recurrent states between the
// pool's banks (gated_delta.cpp has the semantics). One task is one (row, value head): task = b * Hv + h.
struct TmDeltaArgs {
  int32_t isa;  // the kernel table that computes the tasks
  int32_t B, Hk, Hv, dk, dv;
  int32_t x_bf16;                              // qkv, beta and out are bf16 (1) or fp32 (0)
  int64_t qkv_row_stride;                      // elements between rows of qkv
  int64_t q_offset, k_offset, v_offset;        // where a row's q [Hk, dk], k [Hk, dk] and v [Hv, dv] start
  const void* qkv;
  const float* g;                              // [B, Hv] log decay
  const void* beta;                            // [B, Hv]
  float* state;                                // [slots, Hv, dk, dv] fp32
  const int64_t* read;                         // [B] the state slot each row reads
  const int64_t* write;                        // [B] the slot it writes (may equal read)
  void* out;                                   // [B, Hv, dv], contiguous
};

struct TmKernels {
  int isa;
  // Which row copies (TM_ROWS_* bits) this table wants for weights of `fmt` and M rows.
  int (*wants)(int fmt, int M);
  // Bytes of per-thread scratch one up/down call needs for a matrix with K columns and M rows of activations.
  size_t (*scratch_bytes)(int K, int M);
  // gate_up W [2I, K] (gate rows, then up rows): for 16-wide blocks j in [j0, j1):
  //   h[m][16j + l] = glu(x[m] . W[16j + l], x[m] . W[I + 16j + l]), into h_f32 / h_bf16 (non-null ones), glu as
  //   `glu` says (TmGlu: the activation and the expert's bias).
  void (*up)(const TmMatrix* W, const TmGlu* glu, const TmRows* x, int j0, int j1, float* h_f32, uint16_t* h_bf16,
             int ldh, void* scratch);
  // down W [D, I]: for 16-wide blocks c in [c0, c1): y[out[m]][16(c - c0) + l] += w[m] * (h[m] . W[16c + l]).
  void (*down)(const TmMatrix* W, const TmRows* h, int c0, int c1, const int32_t* out, const float* w, float* y,
               int ldy, void* scratch);
  // Called by each thread when a layer is done (AMX releases its tile state).
  void (*finish)(void);
  // The transposed product, for k pairs p in [p0, p1) (multiples of 16: whole int4 / int6 groups):
  //   out[m][2(p - p0) + e] = sum over packed rows r of g[m][r] * V[r][2p + e],
  // where V is W without its row scales (bf16: w; int8: the codes; int4 / int6: gscale * (code - zero)), so g holds M
  // rows in W's packed row order with the row scales already multiplied in, zeros on padding rows, in the copies
  // `wants` asks for (the bf16 copy only for bf16 weights, which have no row scales).
  void (*transposed)(const TmMatrix* W, const TmRows* g, int p0, int p1, float* out, int ldo);
  // Lines (k pairs) [p0, p1) of strip `strip` of an int8 / int4 / int6 W as bf16 lines (the bf16 packed layout), every
  // scale folded in and rounded as dequantising to fp32 and casting to bf16 would: what lets the bf16 kernels
  // multiply quantised weights (training's products with bf16 activations).
  void (*to_bf16)(const TmMatrix* W, int strip, int p0, int p1, uint16_t* dst);
  // One group of 32 columns of S bf16 strips (line q of strip s at lines + s * strip_stride + 32 q) transposed into
  // a bf16 packed matrix T [32, kt] (two strips, kt / 2 lines each; lines from 8 S on untouched): g W for those
  // columns is then the forward product g T^T (training's transposed products with many rows).
  void (*transpose_group)(const uint16_t* lines, size_t strip_stride, int S, uint16_t* dst, int kt);
  // Floats of per-thread scratch one decode-attention task needs, and one task (decode_attention.inc).
  size_t (*attend_scratch_floats)(const TmAttnArgs* a);
  // partial: where the task leaves its partial result (tm_attn_partial_floats), or null to write the output.
  void (*attend)(const TmAttnArgs* a, int task, float* scratch, float* partial);
  // One task of the gated delta rule's decode step (gated_delta.inc).
  void (*delta)(const TmDeltaArgs* a, int task);
};

extern "C" {
const TmKernels* tm_kernels_base(void);
const TmKernels* tm_kernels_avx2(void);
const TmKernels* tm_kernels_avx512(void);
const TmKernels* tm_kernels_avx512bf16(void);
const TmKernels* tm_kernels_amx(void);
}
