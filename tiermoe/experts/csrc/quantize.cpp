// int4 / int6 quantisation at load time, the same algorithm as tiermoe/experts/quant.py `_quantize_grouped`, fused
// per group of 32 so a matrix is read a handful of times from L1 instead of ~20 times from memory (that path takes
// ~0.3 s per expert in torch; this one ~10 ms). Compiled for plain x86-64.
#include <algorithm>
#include <cstdint>

namespace {

constexpr int kGroup = 32;

// Round half to even (like torch.round) without a libm call: adding 1.5 * 2^23 leaves no fraction bits. Exact for
// |v| < 2^22; anything larger is clamped to [0, top] by every caller anyway.
// (IEEE arithmetic: without -ffast-math the compiler may not fold (v + m) - m back to v.)
inline float round_even(float v) {
  constexpr float m = 12582912.0f;
  return (v + m) - m;
}

inline float clampf(float v, float lo, float hi) { return std::min(std::max(v, lo), hi); }

// Best (scale, zero) of one group of 32 weights with codes 0..top: min/max start, then `refits` least-squares refits.
void fit_group(const float* w, int refits, float top, float* s_out, float* z_out) {
  float lo = w[0], hi = w[0], sw = 0, sww = 0;
  for (int i = 0; i < kGroup; ++i) {
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
    sw += w[i];
    sww += w[i] * w[i];
  }
  float s = std::max((hi - lo) / top, 1e-30f);
  float z = clampf(round_even(-lo / s), 0, top);
  float best_err = 0, best_s = s, best_z = z;
  for (int step = 0; step <= refits; ++step) {
    float sq = 0, sqq = 0, sqw = 0;
    for (int i = 0; i < kGroup; ++i) {
      float q = clampf(round_even(w[i] / s + z), 0, top);
      sq += q;
      sqq += q * q;
      sqw += q * w[i];
    }
    float err = s * s * (sqq - 2 * z * sq + kGroup * z * z) - 2 * s * (sqw - z * sw) + sww;
    if (step == 0 || err < best_err) {
      best_err = err;
      best_s = s;
      best_z = z;
    }
    if (step == refits) break;
    float var = sqq - sq * sq / kGroup;
    if (var > 0) s = (sqw - sq * sw / kGroup) / std::max(var, 1e-12f);
    s = std::max(s, 1e-30f);
    z = clampf(round_even(-(sw - s * sq) / (kGroup * s)), 0, top);
  }
  *s_out = best_s;
  *z_out = best_z;
}

// Quantise W [n][k] in groups of 32 with codes 0..top; `store` receives each row's group g: its 32 codes and zero.
template <class Store>
int quantize_grouped(const float* w, int n, int k, int refits, float top, float* row_scale, uint8_t* gscale,
                     Store store) {
  const int kp = (k + 63) / 64 * 64, G = kp / kGroup;
  float buf[kGroup];
  float s[8192], z[8192];
  if (G > 8192) return 1;
  for (int r = 0; r < n; ++r) {
    const float* row = w + (size_t)r * k;
    float smax = 0;
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < kGroup; ++i) buf[i] = g * kGroup + i < k ? row[g * kGroup + i] : 0.0f;
      fit_group(buf, refits, top, &s[g], &z[g]);
      smax = std::max(smax, s[g]);
    }
    const float rs = std::max(smax / 255.0f, 1e-30f);
    row_scale[r] = rs;
    for (int g = 0; g < G; ++g) {
      const float gs = clampf(round_even(s[g] / rs), 1, 255);
      const float step = gs * rs;
      gscale[(size_t)r * G + g] = (uint8_t)gs;
      uint8_t q[kGroup];
      for (int i = 0; i < kGroup; ++i) {
        const float v = g * kGroup + i < k ? row[g * kGroup + i] : 0.0f;
        q[i] = (uint8_t)clampf(round_even(v / step + z[g]), 0, top);
      }
      store(r, g, q, (uint8_t)z[g]);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// w [n][k] fp32 -> codes [n][kp/2], row_scale [n], gscale [n][kp/32], gzero [n][kp/64] (kp = k rounded up to 64).
// Returns 1 (and writes nothing) when k is above 262144.
int tm_quantize_int4(const float* w, int n, int k, int refits, uint8_t* codes, float* row_scale, uint8_t* gscale,
                     uint8_t* gzero) {
  const int kp = (k + 63) / 64 * 64, G = kp / kGroup;
  return quantize_grouped(w, n, k, refits, 15.0f, row_scale, gscale, [&](int r, int g, const uint8_t* q, uint8_t z) {
    for (int i = 0; i < kGroup / 2; ++i) codes[(size_t)r * (kp / 2) + g * (kGroup / 2) + i] = q[2 * i] | (q[2 * i + 1] << 4);
    uint8_t& zb = gzero[(size_t)r * (G / 2) + g / 2];
    zb = (g & 1) ? (uint8_t)(zb | (z << 4)) : z;
  });
}

// w [n][k] fp32 -> codes [n][3 kp / 4] (per row: kp / 2 bytes of low nibbles, two codes a byte, low nibble k even;
// then kp / 4 bytes of high 2-bit pairs, four codes a byte, k % 4 in bits 2 (k % 4), 2 (k % 4) + 1), row_scale [n],
// gscale [n][kp/32], gzero [n][kp/32] (0..63). Returns 1 (and writes nothing) when k is above 262144.
int tm_quantize_int6(const float* w, int n, int k, int refits, uint8_t* codes, float* row_scale, uint8_t* gscale,
                     uint8_t* gzero) {
  const int kp = (k + 63) / 64 * 64, G = kp / kGroup;
  return quantize_grouped(w, n, k, refits, 63.0f, row_scale, gscale, [&](int r, int g, const uint8_t* q, uint8_t z) {
    uint8_t* lo = codes + (size_t)r * (3 * kp / 4) + g * (kGroup / 2);
    uint8_t* hi = codes + (size_t)r * (3 * kp / 4) + kp / 2 + g * (kGroup / 4);
    for (int i = 0; i < kGroup / 2; ++i) lo[i] = (q[2 * i] & 15) | ((q[2 * i + 1] & 15) << 4);
    for (int i = 0; i < kGroup / 4; ++i)
      hi[i] = (q[4 * i] >> 4) | ((q[4 * i + 1] >> 4) << 2) | ((q[4 * i + 2] >> 4) << 4) | ((q[4 * i + 3] >> 4) << 6);
    gzero[(size_t)r * G + g] = z;
  });
}

}  // extern "C"
