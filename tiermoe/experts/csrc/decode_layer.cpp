// One decoder layer of a decode step in one call: Qwen3-MoE's, Mixtral's and GPT-OSS's layer on bf16 rows.
//
//   h   = x + o_proj(attention(rotary(norm_q(q)), rotary(norm_k(k)), v))   with q, k, v = qkv_proj(rms_norm(x))
//   out = h + experts(rms_norm(h), softmax_topk(router(rms_norm(h))))
//
// GPT-OSS's layer is the same chain with biases on q, k, v, o and the router (q, k, v and o's added in bf16 after
// their product, as tiermoe.layers.quantized_linear adds a bias; the router's product in fp32 with its bias added
// before one rounding, as tiermoe.layers.fused_router computes it), rotary in its half-width form, its sinks and
// sliding windows in the attention arguments, the router's top-k taken before its softmax and its experts' own
// activation and biases in the CPU tier's.
//
// Each step is the library's own entry point, called with what the per-op path (tiermoe.layers.fused_attention,
// fused_norm, fused_router, quantized_linear and the CPU tier) passes it, so the output is bit for bit that path's:
// the gain is the host's, one call from Python instead of about sixty dispatched ops and ten native calls per layer.
// The new K/V rows are written into the layer's pool slots as the per-op path's index_copy_ writes them. The
// caller owns every buffer: `work` holds the intermediates (tm_decode_layer_work_bytes), `ids` receives the routed
// experts (the recorder's), `out` the layer's output; nothing is allocated here beyond the entry points' own scratch.
// With LoRA adapters served per request (`lora`, TmDecodeLora) each row adds its adapter's updates where the per-op
// path adds them (tiermoe.layers.row_lora_linear, fused_attention, fused_router): q, k and v after their product,
// o after its own, the router's logits before the top-k, each update computed in fp32 and rounded to bf16 before
// the bf16 addition; the MoE block computes the rows without an adapter as before and the others in a second call
// (tm_moe_lora_forward), and adds the two, as tiermoe.layers.hybrid_moe does. The same values as that path, the
// updates' sums taken in another order.
// Legend: T decode rows, D hidden, H query heads, Hkv KV heads, d head dim, E experts, K top-k, R rank columns.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <vector>

#include "dispatch.h"
#include "lora_math.h"
#include "team.h"
#include "tm_api.h"

extern "C" {

// One product's LoRA for every adapter slot that adapts it (tiermoe.layers.lora_stack): the row t update is
// ((x_t A^T) * mask_t) Bt, fp32. R 0: none.
struct TmLinearLora {
  int32_t R, in, out, factors_bf16;  // factors fp32, or bf16 (a bf16 model's)
  const void* A;                     // [R][in]
  const void* Bt;                    // [R][out]
  const float* mask;                 // [T][R]
};

struct TmDecodeLora {
  TmLinearLora q, k, v, o, router;
  TmLoraArgs moe;  // the experts' (R_gu = R_d = 0: none)
};

struct TmDecodeLayerArgs {
  int32_t T, D, H, Hkv, d, E, K;
  int32_t norm_kind, sum_lanes, exp_lanes;  // the RMSNorms' kind (layer_ops.cpp) and torch's lane counts
  int32_t qk_norm;                          // q and k RMSNorm over each head (Qwen3) before rotary
  int32_t renormalize, weights_bf16;        // the router's tail: renormalised top-k; weights rounded to bf16 first
  int32_t attend_on_team;                   // enough K/V to read that the team shares the attention
  double eps, qk_eps;
  const uint16_t* x;                 // [T, D] the layer's input
  uint16_t* out;                     // [T, D] its output
  const uint16_t* input_norm;        // [D]
  const uint16_t* post_norm;         // [D]
  const uint16_t* q_norm;            // [d] (qk_norm)
  const uint16_t* k_norm;            // [d] (qk_norm)
  TmLinearArgs qkv, o, router;       // the packed products; M, x and out are set here
  TmLinearArgs kv;                   // N > 0: k and v's own product (a format of their own), qkv then q's alone
  const uint16_t* cos;               // [T, d] rows cs_row_stride apart
  const uint16_t* sin;
  int64_t cs_row_stride;
  uint16_t* k_slots;                 // [S, Hkv, d] the layer's pool slots
  uint16_t* v_slots;
  const int64_t* write_slots;        // [T] where each row's new K/V go
  TmAttnArgs attn;                   // the step's page tables and positions; q, out, slots and T are set here
  TmLayerArgs moe;                   // the CPU tier's experts; T, x, y, ids and weights are set here
  int64_t* ids;                      // [T, K] written: the routed experts
  void* work;                        // tm_decode_layer_work_bytes
  const TmDecodeLora* lora;          // adapters served per request: each row's own (null: none)
  int32_t half_rotary;               // cos / sin [T, d / 2]: one value for both halves of a head (GPT-OSS)
  int32_t topk_first;                // the router's top-k before its softmax (GPT-OSS)
  const uint16_t* qkv_bias;          // [(H + 2 Hkv) d] q's, k's and v's biases (null: none)
  const uint16_t* o_bias;            // [D] (null: none)
  const uint16_t* router_bias;       // [E] (null: none)
};

}  // extern "C"

namespace {

// Where the intermediates sit in `work`, each 64-byte aligned.
struct Work {
  size_t normed, qkv, parts, qn, kn, attn, proj, logits, weights, weights_f32, normed_f32, logits_f32, total;
};

Work layout(const TmDecodeLayerArgs& a) {
  const size_t T = a.T, D = a.D, qkv_width = size_t(a.H + 2 * a.Hkv) * a.d;
  Work w{};
  size_t at = 0;
  auto take = [&at](size_t bytes) { size_t here = at; at += tm_align64(bytes); return here; };
  w.normed = take(T * D * 2);
  w.qkv = take(T * qkv_width * 2);
  w.parts = take(a.kv.N > 0 ? T * qkv_width * 2 : 0);
  w.qn = take(T * a.H * a.d * 2);
  w.kn = take(T * a.Hkv * a.d * 2);
  w.attn = take(T * a.H * a.d * 2);
  w.proj = take(T * D * 2);
  w.logits = take(T * a.E * 2);
  w.weights = take(T * a.K * 4);
  w.weights_f32 = take(T * a.K * 4);
  w.normed_f32 = take(a.router_bias ? T * D * 4 : 0);
  w.logits_f32 = take(a.router_bias ? T * a.E * 4 : 0);
  w.total = at;
  return w;
}

// out = a + b in bf16, as torch adds two bf16 tensors: in fp32, rounded once.
void add_rows(const uint16_t* a, const uint16_t* b, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = tm_f32_to_bf16(tm_bf16_to_f32(a[i]) + tm_bf16_to_f32(b[i]));
}

// y[t][0, n) += bias for each of T rows y_stride apart (null bias: nothing), in bf16 as torch adds a bf16 bias.
void add_bias(uint16_t* y, int64_t y_stride, const uint16_t* bias, int T, int64_t n) {
  if (!bias) return;
  for (int t = 0; t < T; ++t) add_rows(y + t * y_stride, bias, y + t * y_stride, n);
}

using tmoe_lora::Factor;

bool any_set(const float* mask, int R) {
  for (int k = 0; k < R; ++k)
    if (mask[k] != 0.0f) return true;
  return false;
}

// One product's LoRA over a step's rows: x rows x_stride apart, y rows y_stride apart.
struct LoraTarget {
  const TmLinearLora* l;
  const uint16_t* x;
  int64_t x_stride;
  uint16_t* y;
  int64_t y_stride;
};

// y_t[0, out) += bf16(update of x_t) when row t has an adapter here; xf [in] and delta [out] are scratch.
void add_lora_row(const LoraTarget& g, int t, float* xf, float* delta) {
  const TmLinearLora& l = *g.l;
  const float* mask = l.mask + (size_t)t * l.R;
  if (!any_set(mask, l.R)) return;
  for (int i = 0; i < l.in; ++i) xf[i] = tm_bf16_to_f32(g.x[t * g.x_stride + i]);
  std::fill(delta, delta + l.out, 0.0f);
  for (int k = 0; k < l.R; ++k) {
    if (mask[k] == 0.0f) continue;
    const float u = mask[k] * Factor{l.A, l.factors_bf16 != 0}.at(k, l.in).dot(xf, l.in);
    Factor{l.Bt, l.factors_bf16 != 0}.at(k, l.out).axpy(u, delta, l.out);
  }
  uint16_t* yt = g.y + t * g.y_stride;
  for (int j = 0; j < l.out; ++j)
    yt[j] = tm_f32_to_bf16(tm_bf16_to_f32(yt[j]) + tm_bf16_to_f32(tm_f32_to_bf16(delta[j])));
}

struct LoraJob {
  std::vector<LoraTarget> targets;
  int T;
  tmoe::Team* team;
};

void run_lora_row(void* ctx, int, int task, int tid) {
  const LoraJob& job = *(const LoraJob*)ctx;
  const LoraTarget& g = job.targets[task / job.T];
  float* xf = (float*)job.team->scratch(tid).data();
  add_lora_row(g, task % job.T, xf, xf + g.l->in);
}

// The updates of several products of the step (`targets`: those no adapter of the step touches are skipped), one
// task per product and row on the kernel team: the layer's next product waits for them, so a core left idle here is
// time added to every step.
void add_loras(void* team, std::initializer_list<LoraTarget> targets, int T) {
  tmoe::Team& t = *(tmoe::Team*)team;
  LoraJob job{{}, T, &t};
  size_t floats = 0;
  for (const LoraTarget& g : targets)
    if (g.l->R) {
      job.targets.push_back(g);
      floats = std::max(floats, (size_t)g.l->in + g.l->out);
    }
  if (job.targets.empty()) return;
  std::lock_guard<std::mutex> lock(t.mutex());
  for (int m = 0; m < t.size(); ++m) t.scratch(m).reserve(sizeof(float) * floats);
  tmoe::Job run;
  run.nphases = 1;
  run.ntasks[0] = (int)job.targets.size() * T;
  run.run = run_lora_row;
  run.ctx = &job;
  t.run(run);
}

// The MoE block of a step with adapter rows (moe.y written): the pairs of rows without expert LoRA here in one call,
// those with it in a tm_moe_lora_forward call, the two results added in bf16.
int experts_with_lora(void* team, TmLayerArgs moe, const TmLoraArgs& lora, char* err, int errlen) {
  const int T = moe.T, K = moe.K;
  std::vector<int64_t> plain(T * K), adapted(T * K);
  int n_plain = 0, n_adapted = 0;
  for (int t = 0; t < T; ++t) {
    const bool has = (lora.R_gu && any_set(lora.gate_up_mask + (size_t)t * lora.R_gu, lora.R_gu)) ||
                     (lora.R_d && any_set(lora.down_mask + (size_t)t * lora.R_d, lora.R_d));
    for (int j = 0; j < K; ++j) {
      const int64_t e = moe.ids[t * K + j];
      plain[t * K + j] = has ? -1 : e;
      adapted[t * K + j] = has ? e : -1;
    }
    (has ? n_adapted : n_plain) += 1;
  }
  auto* y = (uint16_t*)moe.y;
  const size_t n = size_t(T) * moe.D;
  std::vector<uint16_t> extra(n_plain && n_adapted ? n : 0);
  if (n_plain) {
    moe.ids = plain.data();
    if (tm_moe_forward(team, &moe, err, errlen) != 0) return 1;
  }
  if (n_adapted) {
    if (n_plain) moe.y = extra.data();
    moe.ids = adapted.data();
    if (tm_moe_lora_forward(team, &moe, &lora, err, errlen) != 0) return 1;
  }
  if (n_plain && n_adapted) add_rows(y, extra.data(), y, n);
  return 0;
}

// q, k and v of the step's rows side by side in `qkv` [T, (H + 2 Hkv) d]: one product, or q's and kv's each into
// `parts` and then interleaved row by row (a copy of T rows: nothing beside the products' reads).
int qkv_product(void* team, const TmDecodeLayerArgs& a, const uint16_t* normed, uint16_t* qkv, uint16_t* parts,
                char* err, int errlen) {
  if (a.kv.N == 0) return tm_linear_rows(team, a.qkv, a.T, normed, qkv, err, errlen);
  const int64_t q_width = a.qkv.N, kv_width = a.kv.N;
  uint16_t* kv = parts + int64_t(a.T) * q_width;
  if (tm_linear_rows(team, a.qkv, a.T, normed, parts, err, errlen) != 0 ||
      tm_linear_rows(team, a.kv, a.T, normed, kv, err, errlen) != 0)
    return 1;
  for (int64_t t = 0; t < a.T; ++t) {
    std::memcpy(qkv + t * (q_width + kv_width), parts + t * q_width, q_width * 2);
    std::memcpy(qkv + t * (q_width + kv_width) + q_width, kv + t * kv_width, kv_width * 2);
  }
  return 0;
}

// The router's bf16 logits of the normed rows: its product, or with a bias (GPT-OSS) the product of the rows
// widened to fp32 into fp32 logits, the bias added and the sum rounded once (x_f32 [T, D], logits_f32 [T, E]).
int router_logits(void* team, const TmDecodeLayerArgs& a, const uint16_t* normed, float* x_f32, float* logits_f32,
                  uint16_t* logits, char* err, int errlen) {
  if (!a.router_bias) return tm_linear_rows(team, a.router, a.T, normed, logits, err, errlen);
  const size_t n = size_t(a.T) * a.D;
  for (size_t i = 0; i < n; ++i) x_f32[i] = tm_bf16_to_f32(normed[i]);
  TmLinearArgs fp32 = a.router;
  fp32.x_bf16 = 0;
  if (tm_linear_rows(team, fp32, a.T, x_f32, logits_f32, err, errlen) != 0) return 1;
  for (int t = 0; t < a.T; ++t)
    for (int e = 0; e < a.E; ++e)
      logits[t * a.E + e] = tm_f32_to_bf16(logits_f32[t * a.E + e] + tm_bf16_to_f32(a.router_bias[e]));
  return 0;
}

int layer(void* team, const TmDecodeLayerArgs& a, char* err, int errlen) {
  const int T = a.T, D = a.D, H = a.H, Hkv = a.Hkv, d = a.d;
  const Work w = layout(a);
  char* base = (char*)a.work;
  auto* normed = (uint16_t*)(base + w.normed);
  auto* qkv = (uint16_t*)(base + w.qkv);
  auto* attn = (uint16_t*)(base + w.attn);
  auto* proj = (uint16_t*)(base + w.proj);
  const int64_t qkv_width = int64_t(H + 2 * Hkv) * d;

  // attention
  if (tm_rms_norm(a.x, D, a.input_norm, normed, T, D, a.eps, a.norm_kind, 1, 1, 1, a.sum_lanes) != 0)
    return tm_fail(err, errlen, "input RMSNorm: unknown kind or lane count");
  if (qkv_product(team, a, normed, qkv, (uint16_t*)(base + w.parts), err, errlen) != 0) return 1;
  add_bias(qkv, qkv_width, a.qkv_bias, T, qkv_width);
  if (a.lora)
    add_loras(team, {{&a.lora->q, normed, D, qkv, qkv_width}, {&a.lora->k, normed, D, qkv + int64_t(H) * d, qkv_width},
                     {&a.lora->v, normed, D, qkv + int64_t(H + Hkv) * d, qkv_width}}, T);
  uint16_t *q = qkv, *k = qkv + int64_t(H) * d;
  const uint16_t* v = qkv + int64_t(H + Hkv) * d;
  int64_t q_row = qkv_width, k_row = qkv_width;
  if (a.qk_norm) {  // per row of heads: the per-op path normalises a contiguous copy of q and of k
    auto* qn = (uint16_t*)(base + w.qn);
    auto* kn = (uint16_t*)(base + w.kn);
    for (int t = 0; t < T; ++t) {
      if (tm_rms_norm(q + t * qkv_width, d, a.q_norm, qn + int64_t(t) * H * d, H, d, a.qk_eps, a.norm_kind, 1, 1, 1,
                      a.sum_lanes) != 0 ||
          tm_rms_norm(k + t * qkv_width, d, a.k_norm, kn + int64_t(t) * Hkv * d, Hkv, d, a.qk_eps, a.norm_kind, 1, 1,
                      1, a.sum_lanes) != 0)
        return tm_fail(err, errlen, "q / k RMSNorm: unknown kind or lane count");
    }
    q = qn, k = kn, q_row = int64_t(H) * d, k_row = int64_t(Hkv) * d;
  }
  if (tm_rotary_inplace(q, T, H, d, q_row, d, a.cos, a.sin, a.cs_row_stride, a.half_rotary, 1) != 0 ||
      tm_rotary_inplace(k, T, Hkv, d, k_row, d, a.cos, a.sin, a.cs_row_stride, a.half_rotary, 1) != 0)
    return tm_fail(err, errlen, "rotary embedding needs an even head dim");
  const size_t kv_row = size_t(Hkv) * d;
  for (int t = 0; t < T; ++t) {
    std::memcpy(a.k_slots + a.write_slots[t] * kv_row, k + t * k_row, kv_row * 2);
    std::memcpy(a.v_slots + a.write_slots[t] * kv_row, v + t * qkv_width, kv_row * 2);
  }
  TmAttnArgs at = a.attn;
  at.T = T, at.H = H, at.Hkv = Hkv, at.d = d, at.dv = d, at.x_bf16 = 1;
  at.q = q, at.q_row_stride = q_row, at.q_head_stride = d;
  at.k_slots = a.k_slots, at.v_slots = a.v_slots, at.out = attn;
  if (tm_paged_decode_attention(a.attend_on_team ? team : nullptr, &at, err, errlen) != 0) return 1;
  if (tm_linear_rows(team, a.o, T, attn, proj, err, errlen) != 0) return 1;
  add_bias(proj, D, a.o_bias, T, D);
  if (a.lora) add_loras(team, {{&a.lora->o, attn, int64_t(H) * d, proj, D}}, T);
  add_rows(a.x, proj, a.out, size_t(T) * D);

  // experts
  if (tm_rms_norm(a.out, D, a.post_norm, normed, T, D, a.eps, a.norm_kind, 1, 1, 1, a.sum_lanes) != 0)
    return tm_fail(err, errlen, "post-attention RMSNorm: unknown kind or lane count");
  auto* logits = (uint16_t*)(base + w.logits);
  if (router_logits(team, a, normed, (float*)(base + w.normed_f32), (float*)(base + w.logits_f32), logits, err,
                    errlen) != 0)
    return 1;
  if (a.lora) add_loras(team, {{&a.lora->router, normed, D, logits, a.E}}, T);
  void* weights = base + w.weights;
  auto* weights_f32 = (float*)(base + w.weights_f32);
  if (tm_softmax_topk(logits, T, a.E, a.K, 1, a.renormalize, a.weights_bf16, a.exp_lanes, a.sum_lanes, a.topk_first,
                      weights, a.ids) != 0)
    return tm_fail(err, errlen, "router: top-k larger than the experts, or an unknown lane count");
  const int tk = T * a.K;
  for (int i = 0; i < tk; ++i)  // the tier multiplies in fp32 (a bf16 weight widened exactly)
    weights_f32[i] = a.weights_bf16 ? tm_bf16_to_f32(((const uint16_t*)weights)[i]) : ((const float*)weights)[i];
  TmLayerArgs moe = a.moe;
  moe.T = T, moe.K = a.K, moe.x = normed, moe.y = proj, moe.ids = a.ids, moe.weights = weights_f32, moe.x_bf16 = 1;
  if (a.lora && (a.lora->moe.R_gu || a.lora->moe.R_d)) {
    if (experts_with_lora(team, moe, a.lora->moe, err, errlen) != 0) return 1;
  } else if (tm_moe_forward(team, &moe, err, errlen) != 0) {
    return 1;
  }
  add_rows(a.out, proj, a.out, size_t(T) * D);
  return 0;
}

}  // namespace

extern "C" {

size_t tm_decode_layer_work_bytes(const TmDecodeLayerArgs* args) { return layout(*args).total; }

int tm_decode_layer(void* team, const TmDecodeLayerArgs* args, char* err, int errlen) {
  const TmDecodeLayerArgs& a = *args;
  if (a.T < 1 || a.D < 1 || a.H < 1 || a.Hkv < 1 || a.H % a.Hkv != 0 || a.d < 2 || a.K < 1 || a.K > a.E)
    return tm_fail(err, errlen, "decode layer shapes must be positive, with query heads a multiple of KV heads");
  const bool parts = a.kv.N > 0;
  if (a.qkv.N != (parts ? a.H : a.H + 2 * a.Hkv) * a.d || a.qkv.K != a.D ||
      (parts && (a.kv.N != 2 * a.Hkv * a.d || a.kv.K != a.D)) || a.o.N != a.D || a.o.K != a.H * a.d ||
      a.router.N != a.E || a.router.K != a.D || a.moe.D != a.D)
    return tm_fail(err, errlen, "decode layer: a product's shape disagrees with the layer's");
  return layer(team, a, err, errlen);
}

}  // extern "C"
