// DeepSeek's MLA attention of a decode step in one call, on bf16 rows (tiermoe.layers.mla_attention's native decode):
//
//   q      = q_b(rms_norm(q_a(x)))  (or q_proj(x))           [T, H, N + P]: each head's nope part, then its rope part
//   latent = rms_norm(kv_a(x)[:R]), k_pe = rope(kv_a(x)[R:])  written into the layer's pool slots
//   query  = [W_UK^T q_nope | rope(q_pe)] per head            [T, H, R + P]
//   out    = o_proj(W_UV attention(query; [latent | k_pe] keys, latent values))
//
// Each step is the library's own entry point, called with what the per-op path passes it (tiermoe.layers.
// mla_attention with packed linears, fused norms and the native rope: tm_linear_forward, tm_rms_norm, tm_mla_rope,
// tm_heads_linear, tm_paged_decode_attention), so the output is bit for bit that path's; the gain is the host's,
// one call instead of about thirty dispatched ops and eight native calls per layer. The caller owns every buffer
// (`work`: tm_mla_decode_work_bytes). Legend: T decode rows, D hidden, H heads, N / P the nope / rope dims of a
// query head, R the latent (kv_lora_rank), V the value dim, L q_lora_rank.
#include <cstdint>
#include <cstring>

#include "dispatch.h"
#include "tm_api.h"

namespace {

// Where the intermediates sit in `work`, each 64-byte aligned.
struct Work {
  size_t qa, qan, q, kv, latent, query, olat, attn, total;
};

Work layout(const TmMlaDecodeArgs& a) {
  const size_t T = a.T, H = a.H;
  Work w{};
  size_t at = 0;
  auto take = [&at](size_t bytes) { size_t here = at; at += tm_align64(bytes); return here; };
  w.qa = take(a.L ? T * a.L * 2 : 0);
  w.qan = take(a.L ? T * a.L * 2 : 0);
  w.q = take(T * H * (a.N + a.P) * 2);
  w.kv = take(T * (a.R + a.P) * 2);
  w.latent = take(T * a.R * 2);
  w.query = take(T * H * (a.R + a.P) * 2);
  w.olat = take(T * H * a.R * 2);
  w.attn = take(T * H * a.V * 2);
  w.total = at;
  return w;
}

// Every head's product with its block of kv_b_proj's rows (tm_heads_linear): W_UK transposed (first_strip 0) or W_UV.
int heads(void* team, const TmMlaDecodeArgs& a, bool uk, const uint16_t* x, int64_t x_row, int64_t x_head,
          uint16_t* out, int64_t out_row, int64_t out_head, char* err, int errlen) {
  TmHeadsArgs h{};
  h.one = a.kv_b;
  h.one.M = a.T;
  h.one.N = h.one.seg_rows = h.one.seg_len = uk ? a.N : a.V;
  h.one.K = a.R;
  h.one.x = x;
  h.one.out = out;
  h.H = a.H;
  h.first_strip = uk ? 0 : a.H * a.N / 16;
  h.transposed = uk;
  h.x_row = x_row, h.x_head = x_head, h.out_row = out_row, h.out_head = out_head;
  return tm_heads_linear(team, &h, err, errlen);
}

int attention(void* team, const TmMlaDecodeArgs& a, char* err, int errlen) {
  const int T = a.T, H = a.H, N = a.N, P = a.P, R = a.R, V = a.V;
  const Work w = layout(a);
  char* base = (char*)a.work;
  auto* q = (uint16_t*)(base + w.q);
  auto* kv = (uint16_t*)(base + w.kv);
  auto* latent = (uint16_t*)(base + w.latent);
  auto* query = (uint16_t*)(base + w.query);
  auto* olat = (uint16_t*)(base + w.olat);
  auto* attn = (uint16_t*)(base + w.attn);
  const int64_t q_row = int64_t(H) * (N + P), query_row = int64_t(H) * (R + P);

  if (a.L) {  // compressed queries
    auto* qa = (uint16_t*)(base + w.qa);
    auto* qan = (uint16_t*)(base + w.qan);
    if (tm_linear_rows(team, a.q_a, T, a.x, qa, err, errlen) != 0) return 1;
    if (tm_rms_norm(qa, a.L, a.q_a_norm, qan, T, a.L, a.q_eps, a.norm_kind, 1, 1, 1, a.sum_lanes) != 0)
      return tm_fail(err, errlen, "q_a RMSNorm: unknown kind or lane count");
    if (tm_linear_rows(team, a.q_b, T, qan, q, err, errlen) != 0) return 1;
  } else if (tm_linear_rows(team, a.q_a, T, a.x, q, err, errlen) != 0) {
    return 1;
  }
  if (tm_linear_rows(team, a.kv_a, T, a.x, kv, err, errlen) != 0) return 1;
  if (tm_rms_norm(kv, R + P, a.kv_a_norm, latent, T, R, a.kv_eps, a.norm_kind, 1, 1, 1, a.sum_lanes) != 0)
    return tm_fail(err, errlen, "kv_a RMSNorm: unknown kind or lane count");
  if (tm_mla_rope(q + N, T, H, P, q_row, N + P, a.cos, a.sin, a.cs_row_stride, a.rope_form, 1) != 0 ||
      tm_mla_rope(kv + R, T, 1, P, R + P, P, a.cos, a.sin, a.cs_row_stride, a.rope_form, 1) != 0)
    return tm_fail(err, errlen, "rope: unknown form or an odd rope dim");
  for (int t = 0; t < T; ++t) {  // the new keys into the pool, as the per-op path's index_copy_ writes them
    std::memcpy(a.latent_slots + a.write_slots[t] * R, latent + int64_t(t) * R, size_t(R) * 2);
    std::memcpy(a.kpe_slots + a.write_slots[t] * P, kv + int64_t(t) * (R + P) + R, size_t(P) * 2);
    for (int h = 0; h < H; ++h)
      std::memcpy(query + t * query_row + int64_t(h) * (R + P) + R, q + t * q_row + int64_t(h) * (N + P) + N,
                  size_t(P) * 2);
  }
  if (heads(team, a, true, q, q_row, N + P, query, query_row, R + P, err, errlen) != 0) return 1;
  TmAttnArgs at = a.attn;
  at.T = T, at.H = H, at.Hkv = 1, at.d = R, at.dv = R, at.dr = P, at.x_bf16 = 1;
  at.q = query, at.q_row_stride = query_row, at.q_head_stride = R + P;
  at.k_slots = a.latent_slots, at.kr_slots = a.kpe_slots, at.v_slots = a.latent_slots, at.out = olat;
  if (tm_paged_decode_attention(a.attend_on_team ? team : nullptr, &at, err, errlen) != 0) return 1;
  if (heads(team, a, false, olat, int64_t(H) * R, R, attn, int64_t(H) * V, V, err, errlen) != 0) return 1;
  return tm_linear_rows(team, a.o, T, attn, a.out, err, errlen);
}

}  // namespace

extern "C" {

size_t tm_mla_decode_work_bytes(const TmMlaDecodeArgs* args) { return layout(*args).total; }

int tm_mla_decode(void* team, const TmMlaDecodeArgs* args, char* err, int errlen) {
  const TmMlaDecodeArgs& a = *args;
  if (a.T < 1 || a.D < 1 || a.H < 1 || a.N < 16 || a.N % 16 || a.V < 16 || a.V % 16 || a.P < 2 || a.R < 1 ||
      a.L < 0)
    return tm_fail(err, errlen, "MLA decode shapes must be positive, the nope and value dims whole strips");
  const TmLinearArgs& q_first = a.q_a;
  if ((a.L ? q_first.N != a.L || a.q_b.N != a.H * (a.N + a.P) || a.q_b.K != a.L : q_first.N != a.H * (a.N + a.P)) ||
      q_first.K != a.D || a.kv_a.N != a.R + a.P || a.kv_a.K != a.D || a.kv_b.N != a.H * (a.N + a.V) ||
      a.kv_b.K != a.R || a.o.N != a.D || a.o.K != a.H * a.V)
    return tm_fail(err, errlen, "MLA decode: a product's shape disagrees with the attention's");
  return attention(team, a, err, errlen);
}

}  // extern "C"
