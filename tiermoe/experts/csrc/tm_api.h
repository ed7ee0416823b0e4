// The library's entry points that other plain x86-64 units call (decode_layer.cpp chains them), with the argument
// structs they take. Never included by an ISA unit (see tm_kernels.h).
#pragma once
#include <stdint.h>

#include "tm_kernels.h"

extern "C" {

// One packed matrix's product (expert_linear.cpp).
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

// H products of one packed matrix, one per head, in one job (expert_linear.cpp): head i's matrix is the one.N packed
// rows from strip first_strip + i * one.N / 16 of one.W (one segment: seg_rows = seg_len = one.N, a multiple of 16);
// its rows of activations start at one.x + i * x_head, one apart by x_row (elements), its output rows likewise in
// one.out. Forward (out = x W_i^T) or transposed (out = x W_i).
struct TmHeadsArgs {
  TmLinearArgs one;  // a head's product: M, its real N x K, x_bf16; W the whole matrix; x / out head 0's
  int32_t H, first_strip, transposed, _pad;
  int64_t x_row, x_head, out_row, out_head;
};

// One MoE layer's CPU-tier experts (moe_layer.cpp).
struct TmLayerArgs {
  int32_t isa;           // kernel level to use (TM_ISA_*), at most tm_cpu_isa()
  int32_t amx_min_rows;  // experts with at least this many rows use AMX tiles (isa == TM_ISA_AMX)
  int32_t T, D, I, K;    // tokens, hidden, intermediate, top-k
  int32_t Dp, Ip;        // padded hidden / intermediate (multiples of 64)
  int32_t x_bf16;        // x and y are bf16 (1) or fp32 (0)
  int32_t n_experts;     // length of gate_up / down
  const void* x;         // [T, D]
  void* y;               // [T, D], written
  const int64_t* ids;    // [T, K], -1 = another tier's pair
  const float* weights;  // [T, K]
  const TmMatrix* gate_up;  // [n_experts] packed [2Ip, Dp]; codes == NULL where the expert is not held
  const TmMatrix* down;     // [n_experts] packed [Dp, Ip]
  int32_t act;              // TM_ACT_*: how gate and up make the down product's input (TmGlu)
  float alpha, limit;       // TM_ACT_GPT_OSS_GLU's
  int32_t _pad;
  // Per-expert biases, added after each product as transformers' linears add them (GPT-OSS): null, or
  // [n_experts] pointers, each null (no bias) or fp32 values: gate_up [2Ip] in the packed row order (gate rows,
  // then up rows, zeros on padding rows), down [D]. All zero fields: SiLU-GLU without biases.
  const float* const* gate_up_bias;
  const float* const* down_bias;
};

// LoRA adapters served per request on one MoE layer's CPU-tier experts (moe_layer.cpp, tm_moe_lora_forward): every
// pair takes, beside its expert's products, that expert's LoRA update of its token's adapter. Several adapters'
// factors are stacked side by side along the rank (R columns in all) and a 0/1 mask per token picks its own
// adapter's columns (zeros: the base expert alone):
//   gate_up: h = glu(x W_gu^T + ((x A_gu[e]^T) * m_gu[t]) Bt_gu[e])    (the update lands before the activation)
//   down:    y[t] += w * (h W_d^T + ((h A_d[e]^T) * m_d[t]) Bt_d[e])  (h as the down product reads it: bf16 rows
//                                                                      round it when x is bf16)
// Factors fp32 or bf16 (factors_bf16: a bf16 model's), computed in fp32; scalings folded into Bt (B transposed: a
// rank column's update is a contiguous row); Bt_gu's columns are the gate's, then the up's (I each, unpadded). A
// projection with R = 0 has no LoRA (null pointers allowed).
struct TmLoraArgs {
  int32_t R_gu, R_d;
  int32_t factors_bf16, _pad;
  const void* gate_up_A;      // [n_experts][R_gu][D]
  const void* gate_up_Bt;     // [n_experts][R_gu][2I]
  const void* down_A;         // [n_experts][R_d][I]
  const void* down_Bt;        // [n_experts][R_d][D]
  const float* gate_up_mask;  // [T][R_gu]
  const float* down_mask;     // [T][R_d]
};

// DeepSeek's MLA attention of a decode step (mla_decode.cpp has the chain): bf16 rows, packed products.
enum TmMlaRope { TM_MLA_ROPE_HALF = 0, TM_MLA_ROPE_INTERLEAVE = 1, TM_MLA_ROPE_PAIRS = 2 };  // rotary.cpp
struct TmMlaDecodeArgs {
  int32_t T, D, H, N, P, R, V;  // rows, hidden, heads, a query head's nope / rope dims, latent, value dim
  int32_t L;                    // q_lora_rank: q = q_b(norm(q_a(x))); 0: q = q_a(x) (q_a is then q_proj)
  int32_t norm_kind, sum_lanes;  // the RMSNorms' kind (layer_ops.cpp) and torch's lane count
  int32_t rope_form;             // TM_MLA_ROPE_*: cos / sin [T, P] bf16, or (PAIRS) cos the fp32 pairs [T, P / 2, 2]
  int32_t attend_on_team;        // enough work that the team shares the attention
  double q_eps, kv_eps;
  const uint16_t* x;             // [T, D] the attention's input
  uint16_t* out;                 // [T, D] o_proj's output
  TmLinearArgs q_a, q_b, kv_a, kv_b, o;  // packed products (kv_b: rows grouped, each head's W_UK, then W_UV); M, x and
                                         // out are set here
  const uint16_t* q_a_norm;      // [L]
  const uint16_t* kv_a_norm;     // [R]
  const void* cos;
  const void* sin;
  int64_t cs_row_stride;
  uint16_t* latent_slots;        // [S, R] the layer's pool slots
  uint16_t* kpe_slots;           // [S, P]
  const int64_t* write_slots;    // [T] where each row's latent and k_pe go
  TmAttnArgs attn;               // the step's page tables, positions, scale, key splits; the rest is set here
  void* work;                    // tm_mla_decode_work_bytes
};

int tm_linear_forward(void* team, const TmLinearArgs* args, char* err, int errlen);
int tm_heads_linear(void* team, const TmHeadsArgs* args, char* err, int errlen);
int tm_moe_forward(void* team, const TmLayerArgs* args, char* err, int errlen);
int tm_moe_lora_forward(void* team, const TmLayerArgs* args, const TmLoraArgs* lora, char* err, int errlen);
int tm_paged_decode_attention(void* team, const TmAttnArgs* args, char* err, int errlen);
int tm_rms_norm(const void* x, int64_t x_stride, const void* weight, void* out, int rows, int n, double eps, int kind,
                int x_bf16, int w_bf16, int out_bf16, int sum_lanes);
int tm_softmax_topk(const void* logits, int rows, int n, int k, int logits_bf16, int renorm, int weights_bf16,
                    int softmax_lanes, int sum_lanes, int topk_first, void* weights, int64_t* ids);
int tm_rotary_inplace(void* x, int T, int H, int d, int64_t row_stride, int64_t head_stride, const void* cos,
                      const void* sin, int64_t cs_row_stride, int half_width, int bf16);
int tm_mla_rope(void* x, int T, int H, int d, int64_t row_stride, int64_t head_stride, const void* cos, const void* sin,
                int64_t cs_row_stride, int form, int bf16);
int tm_read_probe(void* team, const void* buf, int64_t bytes, int reps, double* best_seconds);
int tm_team_empty_job(void* team);

}  // extern "C"

// One product of a chained call (decode_layer.cpp, mla_decode.cpp): `p` (a packed matrix's arguments) on M rows of x
// into out. Static: each including unit keeps its own copy.
static inline int tm_linear_rows(void* team, TmLinearArgs p, int M, const void* x, void* out, char* err,
                                 int errlen) {
  p.M = M;
  p.x = x;
  p.out = out;
  return tm_linear_forward(team, &p, err, errlen);
}
