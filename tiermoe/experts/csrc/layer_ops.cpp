// Fused per-layer ops for CPU-resident models (tiermoe.layers.fused_norm, fused_router, fused_grouped_router): one
// call where transformers' modules dispatch 6-24 torch ops, computing bit for bit what those ops compute on the CPU.
//
//   tm_rms_norm:     RMSNorm of rows (the three weight conventions of the supported architectures, see NormKind)
//   tm_rms_norm_gated: Qwen3-Next's RMSNorm times silu(gate)
//   tm_softmax_topk: a router's softmax (fp32) -> top-k -> optional renormalisation -> cast, from its logits
//   tm_grouped_topk: DeepSeek-V2/V3 and GLM-4-MoE's routers (sigmoid or softmax, groups, unsorted top-k)
//
// Bit-exactness comes from doing torch's float operations in torch's order (so this file is built for baseline
// x86-64 with no FMA contraction; the one fused multiply-add torch's exp uses is std::fma, exactly rounded):
// - sums: ATen's cascade_sum (native/cpu/SumKernel.cpp): `sum_lanes` accumulators stand for one Vectorized<float>
//   (torch registers the sum kernel without AVX-512, so 8 lanes on AVX2 and AVX-512 CPUs), four of them
//   interleaved, in levels of 16; rows shorter than a vector take its scalar path.
// - softmax: ATen's _vec_softmax_lastdim with `softmax_lanes` lanes (16 AVX-512, 8 AVX2): max and sum by
//   vec::reduce_all (lane-wise, then halving), exp by SLEEF's expf_u10 (the Vectorized<float>::exp torch calls),
//   then times 1 / sum; silu and sigmoid likewise with SLEEF's exp (and libm's on the elements their vector loop
//   leaves).
// - top-k: ATen's topk_impl_loop (native/TopKImpl.h), the same libstdc++ algorithms on the same (value, index)
//   queue, so ties and unsorted results come out in torch's order too.
// Plain C++, one thread (the norm's lane loops are independent, so the compiler vectorises them without changing a
// sum): the callers use it for decode-sized inputs, where the point is one call instead of eight torch ops.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "tm_api.h"

namespace {

enum NormKind {
  kWeightTimesCast = 0,  // weight * (x * r).to(dtype)          (Llama-style: Qwen2/3-MoE, Mixtral, DeepSeek, ...)
  kCastAfterWeight = 1,  // (weight * (x * r)).to(dtype)        (GPT-OSS: the weight multiplied in fp32)
  kOnePlusWeight = 2,    // ((x * r) * (1 + weight.float())).to(dtype)   (Qwen3-Next: zero-centred weight)
};

float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_bf16(float f) {  // c10::BFloat16's round to nearest even
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float load(const void* p, int64_t i, bool bf16) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

void store(void* p, int64_t i, float v, bool bf16) {
  if (bf16) {
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

// Typed element access for the norm's templates: uint16_t holds bf16.
float to_f32(float v) { return v; }
float to_f32(uint16_t v) { return bf16_to_f32(v); }
template <typename T>
T from_f32(float v) {
  if constexpr (sizeof(T) == 2) {
    return f32_to_bf16(v);
  } else {
    return v;
  }
}

constexpr int kMaxLanes = 16;

int64_t ceil_log2(int64_t x) {  // c10::utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(uint64_t(x - 1));
}

// torch's multi_row_sum over `size` groups of 4 items (item = `lanes` consecutive values of `item(j)`), summed
// into acc[4][lanes] in levels so that only sums of similar size meet.
template <int lanes, typename Item>
void multi_row_sum(Item item, int64_t size, float out[4][kMaxLanes]) {
  constexpr int kLevels = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  float acc[kLevels][4][kMaxLanes] = {};
  auto add_group = [&](int64_t i) {
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < lanes; ++l) acc[0][k][l] += item((i * 4 + k) * lanes + l);
  };
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i) add_group(i);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < lanes; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_group(i);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < lanes; ++l) acc[0][k][l] += acc[j][k][l];
  std::memcpy(out, acc[0], sizeof(acc[0]));
}

// torch's row_sum over `size` items: four interleaved partial sums, the leftover items into the first.
template <int lanes, typename Item>
void row_sum(Item item, int64_t size, float out[kMaxLanes]) {
  float partial[4][kMaxLanes];
  const int64_t size_ilp = size / 4;
  multi_row_sum<lanes>(item, size_ilp, partial);
  for (int64_t i = size_ilp * 4; i < size; ++i)
    for (int l = 0; l < lanes; ++l) partial[0][l] += item(i * lanes + l);
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < lanes; ++l) partial[0][l] += partial[k][l];
  std::memcpy(out, partial[0], sizeof(float) * lanes);
}

// torch.sum of the n values item(0..n-1) along a contiguous last dim (cascade_sum with `lanes`-wide vectors).
template <int lanes, typename Item>
float torch_sum(Item item, int64_t n) {
  float lane_sums[kMaxLanes];
  if (n < lanes) {  // scalar_inner_sum
    row_sum<1>(item, n, lane_sums);
    return 0.0f + lane_sums[0];
  }
  const int64_t vectors = n / lanes;
  row_sum<lanes>(item, vectors, lane_sums);  // vectorized_inner_sum
  float total = 0;
  for (int64_t k = vectors * lanes; k < n; ++k) total += item(k);
  for (int l = 0; l < lanes; ++l) total += lane_sums[l];
  return 0.0f + total;  // the output starts at 0 and is accumulated into
}

// vec::reduce_all(op, data, n) with `lanes`-wide vectors: lane-wise over whole vectors and the partial tail, then
// halving (the AVX2 / AVX-512 VecReduceAllSIMD shuffles); fewer values than a vector are folded in order.
template <int lanes, typename Op>
float reduce_all(Op op, const float* x, int64_t n) {
  if (n < lanes) {
    float acc = x[0];
    for (int64_t i = 1; i < n; ++i) acc = op(acc, x[i]);
    return acc;
  }
  float acc[kMaxLanes];
  std::memcpy(acc, x, sizeof(float) * lanes);
  int64_t d = lanes;
  for (; d < n - n % lanes; d += lanes)
    for (int l = 0; l < lanes; ++l) acc[l] = op(acc[l], x[d + l]);
  for (int l = 0; l < n - d; ++l) acc[l] = op(acc[l], x[d + l]);
  for (int w = lanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] = op(acc[l], acc[l + w]);
  return acc[0];
}

float pow2i(int32_t q) {
  uint32_t u = uint32_t(q + 0x7f) << 23;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// SLEEF's xexpf (expf_u10, sleefsimdsp.c) for one lane, as its AVX2 / AVX-512 builds compute it (vmla = FMA).
float sleef_expf(float d) {
  const int32_t q = int32_t(std::nearbyint(d * 1.442695040888963407359924681001892137426645954152985934135449406931f));
  const float qf = float(q);
  float s = std::fma(qf, -0.693145751953125f, d);
  s = std::fma(qf, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.0f + std::fma(s * s, u, s);
  u = u * pow2i(q >> 1) * pow2i(q - (q >> 1));  // vldexp2
  if (d < -104.0f) u = 0.0f;
  if (100.0f < d) u = INFINITY;
  return u;
}

bool before(const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) {  // topk's "largest" order
  return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
}

// RMSNorm of `rows` rows (see tm_rms_norm), with the dtypes, kind and sum width fixed at compile time so the
// per-element loops have no branches.
template <typename X, typename W, typename O, int kind, int lanes>
void norm_rows(const X* x, int64_t x_stride, const W* weight, O* out, int rows, int n, float eps) {
  const float n_f = float(n);
  for (int r = 0; r < rows; ++r, x += x_stride, out += n) {
    const float mean = torch_sum<lanes>([&](int64_t i) { const float v = to_f32(x[i]); return v * v; }, n) / n_f;
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int i = 0; i < n; ++i) {
      const float h = to_f32(x[i]) * scale, w = to_f32(weight[i]);
      if constexpr (kind == kWeightTimesCast) {
        out[i] = from_f32<O>(w * to_f32(from_f32<X>(h)));
      } else if constexpr (kind == kCastAfterWeight) {
        out[i] = from_f32<O>(w * h);
      } else {
        out[i] = from_f32<O>(h * (1.0f + w));
      }
    }
  }
}

template <typename X, typename W, typename O, int kind>
void norm_rows_lanes(const void* x, int64_t x_stride, const void* weight, void* out, int rows, int n, float eps,
                     int lanes) {
  auto run = lanes == 16 ? norm_rows<X, W, O, kind, 16> : norm_rows<X, W, O, kind, 8>;
  run(static_cast<const X*>(x), x_stride, static_cast<const W*>(weight), static_cast<O*>(out), rows, n, eps);
}

template <typename X, typename W, typename O>
void norm_rows_kind(const void* x, int64_t x_stride, const void* weight, void* out, int rows, int n, float eps,
                    int kind, int lanes) {
  auto run = kind == kWeightTimesCast   ? norm_rows_lanes<X, W, O, kWeightTimesCast>
             : kind == kCastAfterWeight ? norm_rows_lanes<X, W, O, kCastAfterWeight>
                                        : norm_rows_lanes<X, W, O, kOnePlusWeight>;
  run(x, x_stride, weight, out, rows, n, eps, lanes);
}

// The two vector widths torch's x86-64 builds use: 8 (AVX2, and the kernels registered without AVX-512), 16.
bool known_lanes(int lanes) { return lanes == 8 || lanes == 16; }

template <typename Item>
float sum_of(int lanes, Item item, int64_t n) {
  return lanes == 16 ? torch_sum<16>(item, n) : torch_sum<8>(item, n);
}

template <typename Op>
float reduce_of(int lanes, Op op, const float* x, int64_t n) {
  return lanes == 16 ? reduce_all<16>(op, x, n) : reduce_all<8>(op, x, n);
}

// x[0, n) = softmax(x) in place, as ATen's _vec_softmax_lastdim computes a row: max, exp(x - max), then times
// 1 / sum.
void softmax(int lanes, float* x, int64_t n) {
  const float max = reduce_of(
      lanes, [](float a, float b) { return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b); }, x, n);
  for (int64_t i = 0; i < n; ++i) x[i] = sleef_expf(x[i] - max);
  const float inv = 1.0f / reduce_of(lanes, [](float a, float b) { return a + b; }, x, n);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// The k largest of `queue` at its front, sorted, as ATen's topk_impl_loop puts them (the same algorithm per size,
// so ties come out in torch's order).
void top_k(std::vector<std::pair<float, int64_t>>& queue, int k) {
  if (int64_t(k) * 64 <= int64_t(queue.size())) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), before);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), before);
    std::sort(queue.begin(), queue.begin() + k - 1, before);
  }
}

}  // namespace

extern "C" {

// out[r] = RMSNorm(x[r]) for `rows` rows of n values (row r of x at x + r * x_stride elements; out contiguous).
// x and out are bf16 (x_bf16) or fp32; the weight's dtype is w_bf16's; out_bf16 is the result's dtype: for
// kWeightTimesCast torch's promotion of (weight, x), else x's. eps is added in fp32, as torch adds a Python float.
// Returns 1 for an unknown kind or lane count.
int tm_rms_norm(const void* x, int64_t x_stride, const void* weight, void* out, int rows, int n, double eps, int kind,
                int x_bf16, int w_bf16, int out_bf16, int sum_lanes) {
  if (kind < kWeightTimesCast || kind > kOnePlusWeight || !known_lanes(sum_lanes)) return 1;
  using bf16 = uint16_t;
  const int dtypes = (x_bf16 ? 4 : 0) | (w_bf16 ? 2 : 0) | (out_bf16 ? 1 : 0);
  auto run = dtypes == 0   ? norm_rows_kind<float, float, float>
             : dtypes == 1 ? norm_rows_kind<float, float, bf16>
             : dtypes == 2 ? norm_rows_kind<float, bf16, float>
             : dtypes == 3 ? norm_rows_kind<float, bf16, bf16>
             : dtypes == 4 ? norm_rows_kind<bf16, float, float>
             : dtypes == 5 ? norm_rows_kind<bf16, float, bf16>
             : dtypes == 6 ? norm_rows_kind<bf16, bf16, float>
                           : norm_rows_kind<bf16, bf16, bf16>;
  run(x, x_stride, weight, out, rows, n, float(eps), kind, sum_lanes);
  return 0;
}

// Qwen3-Next's gated RMSNorm (Qwen3NextRMSNormGated), as out = (y * silu(float(gate))).to(x's dtype) where
// y = weight * RMSNorm(x).to(x's dtype) (bf16 when x and weight are), for `rows` rows of n values of x (row stride
// x_stride) and the contiguous gate [rows, n] (bf16 or fp32). silu is torch's x / (1 + exp(-x)) as its vectorised
// loop runs it over the whole gate at once (torch does so below its 32768-element grain): SLEEF's exp on whole
// pairs of `silu_lanes`-wide vectors, libm's expf on the rest. Returns 1 for an unknown lane count.
int tm_rms_norm_gated(const void* x, int64_t x_stride, const void* gate, const void* weight, void* out, int rows,
                      int n, double eps, int x_bf16, int gate_bf16, int w_bf16, int sum_lanes, int silu_lanes) {
  if (!known_lanes(sum_lanes) || !known_lanes(silu_lanes)) return 1;
  const int64_t total = int64_t(rows) * n, vector_end = total - total % (2 * silu_lanes);
  const float eps_f = float(eps), n_f = float(n);
  const bool y_bf16 = x_bf16 && w_bf16;
  for (int r = 0; r < rows; ++r) {
    const void* xr = static_cast<const char*>(x) + int64_t(r) * x_stride * (x_bf16 ? 2 : 4);
    const auto square = [&](int64_t i) { const float v = load(xr, i, x_bf16); return v * v; };
    const float mean = sum_of(sum_lanes, square, n) / n_f;
    const float scale = 1.0f / std::sqrt(mean + eps_f);
    for (int i = 0; i < n; ++i) {
      const int64_t at = int64_t(r) * n + i;
      const float h = load(xr, i, x_bf16) * scale;
      const float hx = x_bf16 ? bf16_to_f32(f32_to_bf16(h)) : h;
      float y = load(weight, i, w_bf16) * hx;
      if (y_bf16) y = bf16_to_f32(f32_to_bf16(y));
      const float g = load(gate, at, gate_bf16);
      const float silu = g / (1.0f + (at < vector_end ? sleef_expf(-g) : std::exp(-g)));
      store(out, at, y * silu, x_bf16);
    }
  }
  return 0;
}

// A softmax top-k router's tail, per row of `logits` [rows, n] (bf16 or fp32, contiguous), in one of two orders:
//   softmax first: p = softmax(float(logits)); (v, ids) = topk(p, k) (sorted, largest first); renorm: v /= sum(v)
//   top-k first (GPT-OSS): (v, ids) = topk(logits, k); v = softmax(float(v)) (renorm unused: v sums to one)
//   weights = v in bf16 (weights_bf16) or fp32.
// Returns 1 when k is not in [1, n] or for an unknown lane count.
int tm_softmax_topk(const void* logits, int rows, int n, int k, int logits_bf16, int renorm, int weights_bf16,
                    int softmax_lanes, int sum_lanes, int topk_first, void* weights, int64_t* ids) {
  if (k < 1 || k > n || !known_lanes(softmax_lanes) || !known_lanes(sum_lanes)) return 1;
  std::vector<float> p(n), v(k);
  std::vector<std::pair<float, int64_t>> queue(n);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < n; ++i) p[i] = load(logits, int64_t(r) * n + i, logits_bf16);
    if (!topk_first) softmax(softmax_lanes, p.data(), n);
    for (int i = 0; i < n; ++i) queue[i] = {p[i], i};
    top_k(queue, k);
    for (int j = 0; j < k; ++j) v[j] = queue[j].first;
    if (topk_first) softmax(softmax_lanes, v.data(), k);
    const bool divide = renorm && !topk_first;  // top-k-first weights sum to one already
    const float total = divide ? sum_of(sum_lanes, [&](int64_t i) { return v[i]; }, k) : 1.0f;
    for (int j = 0; j < k; ++j) {
      store(weights, int64_t(r) * k + j, divide ? v[j] / total : v[j], weights_bf16);
      ids[int64_t(r) * k + j] = queue[j].second;
    }
  }
  return 0;
}

// DeepSeek-V2/V3 and GLM-4-MoE's routers' tail, per row of fp32 `logits` [rows, n] (contiguous), as their torch
// code computes it (transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter / DeepseekV2TopkRouter):
//   sigmoid (1): s = sigmoid(logits); choice = s + bias; group score = sum of its top 2 choices; the other groups'
//     choices -inf; ids = topk(choice, k, sorted=False); w = s[ids]; renorm: w /= sum(w) + 1e-20
//   softmax (0): s = choice = softmax(logits); group score = its max; the other groups' choices 0;
//     (ids, w) = topk(choice, k, sorted=False)
// then w *= scale. n_group 1 (or topk_group == n_group) selects every group. sigmoid is torch's as its vector loop
// runs it over all rows at once (SLEEF's exp on whole pairs of `exp_lanes`-wide vectors, libm's on the rest).
// Returns 1 for bad sizes or lane counts.
int tm_grouped_topk(const float* logits, int rows, int n, int k, int sigmoid, const float* bias, int n_group,
                    int topk_group, int renorm, double scale, int exp_lanes, int sum_lanes, float* weights,
                    int64_t* ids) {
  if (k < 1 || k > n || n_group < 1 || n % n_group != 0 || topk_group < 1 || topk_group > n_group ||
      (sigmoid && n / n_group < 2) || !known_lanes(exp_lanes) || !known_lanes(sum_lanes))
    return 1;
  const int per_group = n / n_group;
  const int64_t total = int64_t(rows) * n, vector_end = total - total % (2 * exp_lanes);
  const float scale_f = float(scale);
  std::vector<float> score(n), choice(n), w(k);
  std::vector<std::pair<float, int64_t>> queue(n), groups(n_group), pair(per_group);
  for (int r = 0; r < rows; ++r) {
    const float* x = logits + int64_t(r) * n;
    if (sigmoid) {
      for (int i = 0; i < n; ++i) {
        const int64_t at = int64_t(r) * n + i;
        score[i] = 1.0f / ((at < vector_end ? sleef_expf(0.0f - x[i]) : std::exp(-x[i])) + 1.0f);
        choice[i] = bias ? score[i] + bias[i] : score[i];
      }
    } else {
      const float max = reduce_of(
          exp_lanes, [](float a, float b) { return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b); }, x, n);
      for (int i = 0; i < n; ++i) score[i] = sleef_expf(x[i] - max);
      const float inv = 1.0f / reduce_of(exp_lanes, [](float a, float b) { return a + b; }, score.data(), n);
      for (int i = 0; i < n; ++i) choice[i] = score[i] = score[i] * inv;
    }
    if (topk_group < n_group) {
      for (int g = 0; g < n_group; ++g) {
        const float* c = choice.data() + int64_t(g) * per_group;
        float group_score;
        if (sigmoid) {  // topk(2) values, summed
          for (int i = 0; i < per_group; ++i) pair[i] = {c[i], i};
          std::nth_element(pair.begin(), pair.begin() + 1, pair.end(), before);
          group_score = (0.0f + std::max(pair[0].first, pair[1].first)) + std::min(pair[0].first, pair[1].first);
        } else {
          group_score = *std::max_element(c, c + per_group);
        }
        groups[g] = {group_score, g};
      }
      std::nth_element(groups.begin(), groups.begin() + topk_group - 1, groups.end(), before);
      std::vector<char> keep(n_group, 0);
      for (int g = 0; g < topk_group; ++g) keep[groups[g].second] = 1;
      for (int i = 0; i < n; ++i)
        if (!keep[i / per_group]) choice[i] = sigmoid ? -INFINITY : 0.0f;
    }
    for (int i = 0; i < n; ++i) queue[i] = {choice[i], i};
    if (int64_t(k) * 64 <= n) {
      std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), before);
    } else {
      std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), before);
    }
    for (int j = 0; j < k; ++j) w[j] = sigmoid ? score[queue[j].second] : queue[j].first;
    if (renorm) {
      const float denominator = sum_of(sum_lanes, [&](int64_t i) { return w[i]; }, k) + 1e-20f;
      for (int j = 0; j < k; ++j) w[j] /= denominator;
    }
    for (int j = 0; j < k; ++j) {
      weights[int64_t(r) * k + j] = w[j] * scale_f;
      ids[int64_t(r) * k + j] = queue[j].second;
    }
  }
  return 0;
}

}  // extern "C"
