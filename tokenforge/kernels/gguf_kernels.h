// The inner loops of the CPU GGUF kernels, shared by gguf_cpu.cpp (one projection per call) and
// gguf_decode.cpp (a whole decode step per call): the per-block activation quantizer and one panel
// of 16 weight rows against M int8 activation rows (`matmul_panel`: AVX-512 VNNI dpbusd, else AVX2
// maddubs (or AVX-VNNI) on half panels, else plain loops). Formats: below and gguf_cpu.cpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define TF_AVX512 1     // a whole panel (16 rows) per 512-bit dot product
#else
#define TF_AVX512 0
#endif

namespace tf {

#if defined(__AVX2__)
inline __m256i dot_u8s8(__m256i u, __m256i s) {     // 8 x int32: sums of 4 adjacent u8*s8 products
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

inline float dot_f32(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    float acc = 0.f;
#if defined(__AVX2__)
    __m256 v = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v);
    acc = hsum(v);
#endif
    for (; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

constexpr int64_t kMaxRow = 16384;      // the widest row the fused prologues take (gguf_cpu.py checks)

#if TF_AVX512
// e^x, 16 at a time, for x in [-87, 88] (clamped): x = n ln2 + r, |r| <= ln2 / 2, e^r by its
// degree-6 Taylor polynomial (relative error ~1e-7), times 2^n.
inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);      // ln2 in two parts (Cody-Waite)
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_scalef_ps(p, n);
}
#endif

// out [K] = silu(g) * u (the SwiGLU before down), vectorised where AVX-512 is.
inline void silu_mul_row(const float* g, const float* u, int64_t K, float* out) {
    int64_t j = 0;
#if TF_AVX512
    const __m512 one = _mm512_set1_ps(1.f);
    for (; j + 16 <= K; j += 16) {
        const __m512 x = _mm512_loadu_ps(g + j);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + j)));
    }
#endif
    for (; j < K; ++j) out[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
}

// One block of 32 floats -> 32 int8 codes (scale amax / 127, round half to even), its scale, and
// each half's code sum (what a min, and the i8 codes' bias, multiply). The vector and scalar
// versions give the same bits (one rounding each for the scale, its inverse and every product).
inline void quantize_block(const float* v, int8_t* q, float* d_out, int32_t* s_out) {
#if TF_AVX512
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));          // |codes| <= 127
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
    *d_out = d;
    s_out[0] = _mm512_reduce_add_epi32(qa);
    s_out[1] = _mm512_reduce_add_epi32(qb);
#else
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(v[j]));
    const float d = amax / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    *d_out = d;
    int32_t s0 = 0, s1 = 0;
    for (int j = 0; j < 32; ++j) {
        const int8_t c = static_cast<int8_t>(std::nearbyint(v[j] * inv));
        q[j] = c;
        (j < 16 ? s0 : s1) += c;
    }
    s_out[0] = s0;
    s_out[1] = s1;
#endif
}

// Weights in panels of 16 output rows (gguf_repack.py `PackedWeight` has the layout): per panel
// and block of 32 inputs, 64-byte vectors whose lane i (4 bytes) is the panel's row i -- u4: 4
// vectors, byte j of vector v holds elements 4v+j (low nibble) and 16+4v+j (high); i8: 8 vectors,
// byte j of vector v holds element 4v+j + 128 -- then the scales (and mins) per lane: u4 [blocks][16],
// i8 [blocks][2][16] (one per 16 elements). A block's dot products take a lane's 4 codes against
// the activation row's 4 bytes, broadcast, so 16 outputs' integer sums complete before the one
// float scale-and-add per block (and per 16 for i8) the format needs. Activations: xq [M, K],
// dx [M, K/32], xs [M, K/16] the code sums per 16 (a min multiplies dx * xs).
constexpr int64_t kPanel = 16;

// Kinds: 0 u4 (a scale per 32), 1 i8 with a scale per 16 (Q6_K), 2 i8 with a scale per 32 (Q8_0,
// Q5_x: their two 16s always share one, so the kernel pays one float epilogue a block, not two).
inline int64_t scale_groups(int kind) { return kind == 1 ? 2 : 1; }       // scales per block of 32
inline int64_t panel_bytes(int kind, int64_t blocks) { return blocks * (kind == 0 ? 256 : 512); }
inline int64_t panel_scales(int kind, int64_t blocks) { return blocks * kPanel * scale_groups(kind); }

#if TF_AVX512
// R activation rows against one panel, into acc[R] (16 outputs each). u4 codes are unsigned, so
// dpbusd takes them as they are; i8 codes are stored + 128 for the same reason, and the bias comes
// back out in the integers: sum((q + 128) x) - 128 sum(x), exactly (taken out in float instead,
// the two terms' sizes cost 60x the rounding error of a signed product when activations had a mean).
template <int R>
inline void panel_u4(const uint8_t* pq, const float* ps, const float* pm, int64_t K, const int8_t* xq,
                     const float* dx, const int32_t* xs, __m512* acc) {
    const int64_t blocks = K / 32;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i w[8];                                   // w[g]: elements 4g..4g+3 of the block, per row
        for (int v = 0; v < 4; ++v) {
            const __m512i raw = _mm512_loadu_si512(pq + b * 256 + v * 64);
            w[v] = _mm512_and_si512(raw, low);
            w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        const __m512 s = _mm512_loadu_ps(ps + b * kPanel);
        const __m512 mn = pm == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(pm + b * kPanel);
        for (int r = 0; r < R; ++r) {
            const int32_t* x = reinterpret_cast<const int32_t*>(xq + r * K + 32 * b);
            __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();     // two chains: 7% faster
            for (int g = 0; g < 4; ++g) {
                i0 = _mm512_dpbusd_epi32(i0, w[g], _mm512_set1_epi32(x[g]));
                i1 = _mm512_dpbusd_epi32(i1, w[g + 4], _mm512_set1_epi32(x[g + 4]));
            }
            const __m512i isum = _mm512_add_epi32(i0, i1);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s, _mm512_set1_ps(dx[r * blocks + b])),
                                     acc[r]);
            const int64_t i = r * blocks + b;
            acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(dx[i] * static_cast<float>(xs[2 * i] + xs[2 * i + 1])), acc[r]);
        }
    }
}

template <int R, int G>     // G scale groups a block: 2 (kind 1) or 1 (kind 2)
inline void panel_i8(const uint8_t* pq, const float* ps, const float* pm, int64_t K, const int8_t* xq,
                     const float* dx, const int32_t* xs, __m512* acc) {
    const int64_t blocks = K / 32;
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i w[8];
        for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(pq + b * 512 + g * 64);
        const float* sb = ps + b * G * kPanel;
        for (int r = 0; r < R; ++r) {
            const int32_t* x = reinterpret_cast<const int32_t*>(xq + r * K + 32 * b);
            const int64_t i = r * blocks + b;
            __m512i i0 = _mm512_set1_epi32(-128 * xs[2 * i]), i1 = _mm512_set1_epi32(-128 * xs[2 * i + 1]);
            for (int g = 0; g < 4; ++g) {
                i0 = _mm512_dpbusd_epi32(i0, w[g], _mm512_set1_epi32(x[g]));
                i1 = _mm512_dpbusd_epi32(i1, w[g + 4], _mm512_set1_epi32(x[g + 4]));
            }
            const __m512 d = _mm512_set1_ps(dx[i]);
            if (G == 1) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), _mm512_mul_ps(_mm512_loadu_ps(sb), d),
                                         acc[r]);
                if (pm != nullptr)
                    acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(pm + b * kPanel),
                                             _mm512_set1_ps(dx[i] * static_cast<float>(xs[2 * i] + xs[2 * i + 1])), acc[r]);
                continue;
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(_mm512_loadu_ps(sb), d), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(_mm512_loadu_ps(sb + 16), d), acc[r]);
            if (pm != nullptr) {
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(pm + b * 32), _mm512_set1_ps(dx[i] * static_cast<float>(xs[2 * i])),
                                         acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(pm + b * 32 + 16),
                                         _mm512_set1_ps(dx[i] * static_cast<float>(xs[2 * i + 1])), acc[r]);
            }
        }
    }
}

template <int R>
inline void panel_tile(int kind, const uint8_t* pq, const float* ps, const float* pm, int64_t K, const int8_t* xq,
                       const float* dx, const int32_t* xs, float* out, int64_t stride, __mmask16 mask) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    if (kind == 0)
        panel_u4<R>(pq, ps, pm, K, xq, dx, xs, acc);
    else if (kind == 1)
        panel_i8<R, 2>(pq, ps, pm, K, xq, dx, xs, acc);
    else
        panel_i8<R, 1>(pq, ps, pm, K, xq, dx, xs, acc);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * stride, mask, acc[r]);
}

#elif defined(__AVX2__)
// Half a panel (8 rows, h = 0 or 1) per call. i8 codes come back to signed (xor 0x80) for the
// sign trick: maddubs's int16 pairs would saturate on (q + 128) * x, not on |q| * (x sign q).
template <int R>
inline void panel_half(int kind, int h, const uint8_t* pq, const float* ps, const float* pm, int64_t K,
                       const int8_t* xq, const float* dx, const int32_t* xs, __m256* acc) {
    const int64_t blocks = K / 32;
    const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i w[8], sign[8];
        for (int g = 0; g < 8; ++g) {
            if (kind == 0) {
                const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pq + b * 256 + (g % 4) * 64 + h * 32));
                w[g] = g < 4 ? _mm256_and_si256(raw, low) : _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            } else {
                sign[g] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pq + b * 512 + g * 64 + h * 32)), flip);
                w[g] = _mm256_sign_epi8(sign[g], sign[g]);
            }
        }
        for (int r = 0; r < R; ++r) {
            const int32_t* x = reinterpret_cast<const int32_t*>(xq + r * K + 32 * b);
            const int64_t i = r * blocks + b;
            __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int g = 0; g < 8; ++g) {
                const __m256i xb = _mm256_set1_epi32(x[g]);
                const int half = kind == 1 ? g / 4 : 0;
                isum[half] = _mm256_add_epi32(isum[half], dot_u8s8(w[g], kind == 0 ? xb : _mm256_sign_epi8(xb, sign[g])));
            }
            const __m256 d = _mm256_set1_ps(dx[i]);
            for (int half = 0; half < scale_groups(kind); ++half) {
                const int64_t at = (b * scale_groups(kind) + half) * kPanel + 8 * h;
                const float sum = kind == 1 ? static_cast<float>(xs[2 * i + half]) : static_cast<float>(xs[2 * i] + xs[2 * i + 1]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[half]), _mm256_mul_ps(_mm256_loadu_ps(ps + at), d), acc[r]);
                if (pm != nullptr) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(pm + at), _mm256_set1_ps(dx[i] * sum), acc[r]);
            }
        }
    }
}
#endif

// Asks for a panel's codes, scales and mins ahead of use (into L2): called one panel early, it
// overlaps the weight stream (a decode step reads every weight once, from memory) with compute.
inline void prefetch_panel(int kind, const uint8_t* pq, const float* ps, const float* pm, int64_t blocks) {
    const char* q = reinterpret_cast<const char*>(pq);
    for (int64_t at = 0; at < panel_bytes(kind, blocks); at += 64) _mm_prefetch(q + at, _MM_HINT_T1);
    for (int64_t at = 0; at < panel_scales(kind, blocks); at += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(ps + at), _MM_HINT_T1);
        if (pm != nullptr) _mm_prefetch(reinterpret_cast<const char*>(pm + at), _MM_HINT_T1);
    }
}

// One panel (`valid` <= 16 real rows) against M activation rows: out[m * stride + i], i < valid.
inline void matmul_panel(int kind, const uint8_t* pq, const float* ps, const float* pm, int64_t K, const int8_t* xq,
                         const float* dx, const int32_t* xs, int64_t M, float* out, int64_t stride, int64_t valid) {
    const int64_t blocks = K / 32;
#if TF_AVX512
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    int64_t m = 0;
    for (; m + 8 <= M; m += 8)
        panel_tile<8>(kind, pq, ps, pm, K, xq + m * K, dx + m * blocks, xs + 2 * m * blocks, out + m * stride, stride, mask);
    for (; m + 4 <= M; m += 4)
        panel_tile<4>(kind, pq, ps, pm, K, xq + m * K, dx + m * blocks, xs + 2 * m * blocks, out + m * stride, stride, mask);
    for (; m < M; ++m)
        panel_tile<1>(kind, pq, ps, pm, K, xq + m * K, dx + m * blocks, xs + 2 * m * blocks, out + m * stride, stride, mask);
#elif defined(__AVX2__)
    for (int h = 0; h * 8 < valid; ++h) {
        for (int64_t m = 0; m < M; m += 4) {
            __m256 acc[4];
            for (auto& a : acc) a = _mm256_setzero_ps();
            const int64_t rows = std::min<int64_t>(4, M - m);
            if (rows == 4)
                panel_half<4>(kind, h, pq, ps, pm, K, xq + m * K, dx + m * blocks, xs + 2 * m * blocks, acc);
            else
                for (int64_t r = 0; r < rows; ++r)
                    panel_half<1>(kind, h, pq, ps, pm, K, xq + (m + r) * K, dx + (m + r) * blocks,
                                  xs + 2 * (m + r) * blocks, acc + r);
            for (int64_t r = 0; r < rows; ++r) {
                float lanes[8];
                _mm256_storeu_ps(lanes, acc[r]);
                for (int64_t i = 0; i < std::min<int64_t>(8, valid - 8 * h); ++i) out[(m + r) * stride + 8 * h + i] = lanes[i];
            }
        }
    }
#else
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t i = 0; i < valid; ++i) {
            float acc = 0.f;
            for (int64_t b = 0; b < blocks; ++b) {
                const int8_t* x = xq + m * K + 32 * b;
                const int64_t at = m * blocks + b;
                for (int half = 0; half < scale_groups(kind); ++half) {
                    int32_t s = 0;
                    for (int g = 4 * half; g < (kind == 2 ? 8 : 4 * half + 4); ++g)
                        for (int j = 0; j < 4; ++j) {
                            const uint8_t c = pq[b * (kind == 0 ? 256 : 512) + g * 64 + i * 4 + j];
                            s += kind == 0 ? (c & 0x0F) * x[4 * g + j] + (c >> 4) * x[16 + 4 * g + j]
                                           : (static_cast<int32_t>(c) - 128) * x[4 * g + j];
                        }
                    const int64_t lane = (b * scale_groups(kind) + half) * kPanel + i;
                    const int32_t sum = kind == 1 ? xs[2 * at + half] : xs[2 * at] + xs[2 * at + 1];
                    acc += static_cast<float>(s) * (ps[lane] * dx[at]);
                    if (pm != nullptr) acc += pm[lane] * (dx[at] * static_cast<float>(sum));
                }
            }
            out[m * stride + i] = acc;
        }
    }
#endif
}

}  // namespace tf
