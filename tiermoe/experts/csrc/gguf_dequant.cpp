// GGUF block formats to fp32, for loading GGUF experts: the gguf package's numpy dequantisation reads 30-70 MB
// of file per second on one core, hours for a DeepSeek-V3 Q4_K file; this runs each block in one pass, on several
// threads. Same values as gguf.quants (same float32 operations in the same order, no FMA: this file is built for
// baseline x86-64), which the tests check bit for bit.
//
// Block layouts (llama.cpp's, QK_K = 256 values per super-block; d, dmin are IEEE half):
//   Q8_0  34 B / 32:   d, int8 q[32]                                   y = q * d
//   Q4_K 144 B / 256:  d, dmin, scales[12], qs[128]                    y = (d * sc[j]) * q - (dmin * m[j])
//   Q5_K 176 B / 256:  d, dmin, scales[12], qh[32], qs[128]            as Q4_K with a fifth bit from qh
//   Q6_K 210 B / 256:  ql[128], qh[64], int8 scales[16], d            y = (d * sc[i / 16]) * (q - 32)
// Q4_K / Q5_K: 8 sub-blocks of 32 values with 6-bit scales and mins packed in 12 bytes; sub-block j of a chunk of
// 64 takes the low nibbles of 32 bytes, sub-block j + 1 their high nibbles.

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

float half_to_float(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);  // inf / nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal half: normalise (every half is exactly a float)
        int shift = 0;
        while (!(man & 0x400)) {
            man <<= 1;
            ++shift;
        }
        bits = sign | uint32_t(113 - shift) << 23 | ((man & 0x3FF) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
void scale_min(const uint8_t* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

void q8_0(const uint8_t* b, float* y) {
    float d = half_to_float(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < 32; ++i) y[i] = float(q[i]) * d;
}

// Q4_K (qh == nullptr) and Q5_K.
void q45_k(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* y) {
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t* scales = b + 4;
    for (int chunk = 0; chunk < 4; ++chunk) {
        for (int half = 0; half < 2; ++half) {
            int j = 2 * chunk + half, sc, m;
            scale_min(scales, j, &sc, &m);
            float dl = d * float(sc), ml = dmin * float(m);
            for (int l = 0; l < 32; ++l) {
                int q = (qs[32 * chunk + l] >> (4 * half)) & 0x0F;
                if (qh != nullptr) q |= ((qh[l] >> j) & 1) << 4;
                y[32 * j + l] = dl * float(q) - ml;
            }
        }
    }
}

void q6_k(const uint8_t* b, float* y) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    float d = half_to_float(b + 208);
    for (int n = 0; n < 2; ++n) {  // two halves of 128 values: ql 64 bytes, qh 32 bytes each
        for (int part = 0; part < 4; ++part) {  // values 32 * part + l of this half
            for (int l = 0; l < 32; ++l) {
                int low = (ql[64 * n + l + 32 * (part & 1)] >> (4 * (part >> 1))) & 0x0F;
                int high = (qh[32 * n + l] >> (2 * part)) & 3;
                int v = 128 * n + 32 * part + l;
                y[v] = (d * float(sc[v / 16])) * float((low | (high << 4)) - 32);
            }
        }
    }
}

struct Format {
    int block_bytes, block_values;
};

Format format_of(int kind) {
    switch (kind) {
        case 8: return {34, 32};     // Q8_0
        case 12: return {144, 256};  // Q4_K
        case 13: return {176, 256};  // Q5_K
        case 14: return {210, 256};  // Q6_K
        default: return {0, 0};
    }
}

void run(int kind, const uint8_t* src, float* dst, int64_t first, int64_t last) {
    Format f = format_of(kind);
    for (int64_t i = first; i < last; ++i) {
        const uint8_t* b = src + i * f.block_bytes;
        float* y = dst + i * f.block_values;
        switch (kind) {
            case 8: q8_0(b, y); break;
            case 12: q45_k(b, nullptr, b + 16, y); break;
            case 13: q45_k(b, b + 16, b + 48, y); break;
            case 14: q6_k(b, y); break;
        }
    }
}

}  // namespace

// Dequantise `n_blocks` blocks of GGML type `kind` (its GGMLQuantizationType value) from `src` into `dst`
// (n_blocks x values-per-block floats) on `n_threads` threads. Returns 0, or -1 for a type this file lacks.
extern "C" int tm_gguf_dequant(int kind, const uint8_t* src, float* dst, int64_t n_blocks, int n_threads) {
    if (format_of(kind).block_bytes == 0) return -1;
    int64_t threads = n_threads < 1 ? 1 : n_threads;
    if (threads > n_blocks / 64) threads = n_blocks / 64 > 0 ? n_blocks / 64 : 1;  // small slices: no thread cost
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < threads; ++t)
        pool.emplace_back(run, kind, src, dst, n_blocks * t / threads, n_blocks * (t + 1) / threads);
    run(kind, src, dst, 0, n_blocks / threads);
    for (auto& th : pool) th.join();
    return 0;
}
