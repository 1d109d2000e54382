// The inner loops of the CPU GGUF kernels, shared by gguf_cpu.cpp (one projection per call) and
// gguf_decode.cpp (a whole decode step per call): block dot products of u4 / i8 weight rows with
// int8 activations (AVX2 maddubs, VNNI dpbusd where the CPU has it; AVX-512 VNNI takes two blocks
// per instruction), the per-block activation quantizer, and one weight row against M activation
// rows (`matmul_row`). Formats: see gguf_cpu.cpp.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define TF_AVX512 1     // two blocks of 32 per 512-bit dot product
#else
#define TF_AVX512 0
#endif

namespace tf {

#if TF_AVX512
inline __m512 pair_ps(float a, float b) {           // [a x 8 | b x 8]: one value per block of a pair
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a)), _mm256_set1_ps(b), 1);
}
#endif

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

// R outputs: one weight row (u4) . R activation rows; the weight block is unpacked once for all R.
template <int R>
inline void dot_u4(const uint8_t* qs, const float* scale, const int8_t* xq, const float* dx, int64_t K,
                   int64_t blocks, float* out, int64_t out_stride) {
#if defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0F);
    int64_t b = 0;
#if TF_AVX512
    __m512 wide[R];
    for (int r = 0; r < R; ++r) wide[r] = _mm512_setzero_ps();
    const __m256i low256 = _mm256_set1_epi8(0x0F);
    for (; b + 2 <= blocks; b += 2) {           // two blocks a step: [low 0 | high 0 | low 1 | high 1]
        __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 16 * b));
        __m512i halves = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, low256)),
                                            _mm256_and_si256(_mm256_srli_epi16(packed, 4), low256), 1);
        __m512i q = _mm512_shuffle_i64x2(halves, halves, _MM_SHUFFLE(3, 1, 2, 0));
        __m512 s = pair_ps(scale[b], scale[b + 1]);
        for (int r = 0; r < R; ++r) {
            __m512i x = _mm512_loadu_si512(xq + r * K + 32 * b);
            __m512 d = _mm512_mul_ps(s, pair_ps(dx[r * blocks + b], dx[r * blocks + b + 1]));
            wide[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x)), d, wide[r]);
        }
    }
#endif
    for (; b < blocks; ++b) {
        __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * b));
        __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low), _mm_and_si128(packed, low));
        for (int r = 0; r < R; ++r) {
            __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + 32 * b));
            __m256 d = _mm256_set1_ps(dx[r * blocks + b] * scale[b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q, x)), d, acc[r]);
        }
    }
#if TF_AVX512
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]) + _mm512_reduce_add_ps(wide[r]);
#else
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]);
#endif
#else
    for (int r = 0; r < R; ++r) {
        float acc = 0.f;
        const int8_t* x = xq + r * K;
        for (int64_t b = 0; b < blocks; ++b) {
            int32_t s = 0;
            for (int j = 0; j < 16; ++j)
                s += (qs[16 * b + j] & 0x0F) * x[32 * b + j] + (qs[16 * b + j] >> 4) * x[32 * b + 16 + j];
            acc += dx[r * blocks + b] * scale[b] * static_cast<float>(s);
        }
        out[r * out_stride] = acc;
    }
#endif
}

// R outputs: one weight row (i8, a scale per 16) . R activation rows.
template <int R>
inline void dot_i8(const int8_t* q, const float* scale, const int8_t* xq, const float* dx, int64_t K,
                   int64_t blocks, float* out, int64_t out_stride) {
#if defined(__AVX2__)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
#if TF_AVX512
    __m512 wide[R];
    for (int r = 0; r < R; ++r) wide[r] = _mm512_setzero_ps();
    const __m512i quads = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (; b + 2 <= blocks; b += 2) {           // two blocks a step; lanes 4i..4i+3: the i-th 16
        __m512i w = _mm512_loadu_si512(q + 32 * b);
        __m512i w_abs = _mm512_abs_epi8(w);
        __mmask64 negative = _mm512_movepi8_mask(w);
        __m512 s = _mm512_permutexvar_ps(quads, _mm512_castps128_ps512(_mm_loadu_ps(scale + 2 * b)));
        for (int r = 0; r < R; ++r) {
            __m512i x = _mm512_loadu_si512(xq + r * K + 32 * b);
            __m512i x_signed = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
            __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w_abs, x_signed);
            __m512 d = _mm512_mul_ps(s, pair_ps(dx[r * blocks + b], dx[r * blocks + b + 1]));
            wide[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), d, wide[r]);
        }
    }
#endif
    for (; b < blocks; ++b) {
        __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b));
        __m256i w_abs = _mm256_sign_epi8(w, w);
        __m256 s = _mm256_set_m128(_mm_set1_ps(scale[2 * b + 1]), _mm_set1_ps(scale[2 * b]));
        for (int r = 0; r < R; ++r) {
            __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + 32 * b));
            // |w| (unsigned) times x carrying w's sign: the signed product through an unsigned-signed dot.
            __m256i sums = dot_u8s8(w_abs, _mm256_sign_epi8(x, w));       // lanes 0-3: the first 16
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(s, _mm256_set1_ps(dx[r * blocks + b])),
                                     acc[r]);
        }
    }
#if TF_AVX512
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]) + _mm512_reduce_add_ps(wide[r]);
#else
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]);
#endif
#else
    for (int r = 0; r < R; ++r) {
        float acc = 0.f;
        const int8_t* x = xq + r * K;
        for (int64_t b = 0; b < blocks; ++b) {
            for (int h = 0; h < 2; ++h) {
                int32_t s = 0;
                for (int j = 0; j < 16; ++j) s += q[32 * b + 16 * h + j] * x[32 * b + 16 * h + j];
                acc += dx[r * blocks + b] * scale[2 * b + h] * static_cast<float>(s);
            }
        }
        out[r * out_stride] = acc;
    }
#endif
}

template <int R>
inline void dot_rows(int kind, const uint8_t* wq, const float* ws, const int8_t* xq, const float* dx, int64_t K,
                     int64_t blocks, float* out, int64_t out_stride) {
    if (kind == 0)
        dot_u4<R>(wq, ws, xq, dx, K, blocks, out, out_stride);
    else
        dot_i8<R>(reinterpret_cast<const int8_t*>(wq), ws, xq, dx, K, blocks, out, out_stride);
}

constexpr int64_t kMaxRow = 16384;      // the widest row the fused prologues take (gguf_cpu.py checks)

// One block of 32 floats -> 32 int8 codes (scale amax / 127, round half to even), its scale, and
// the scale times each half's code sum.
inline void quantize_block(const float* v, int8_t* q, float* d_out, float* f_out) {
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
    f_out[0] = d * static_cast<float>(s0);
    f_out[1] = d * static_cast<float>(s1);
}

// One weight row (u4: kind 0, i8: kind 1) of K inputs against M activation rows: out[m * stride]
// for m < M. `wmin` (the row's mins; null: none) multiplies `fmin`: the activations' dx * sum of
// codes per 32 (u4) or per 16 (i8).
inline void matmul_row(int kind, const uint8_t* wq, const float* ws, const float* wmin, int64_t K,
                       const int8_t* xq, const float* dx, const float* fmin, int64_t M, float* out, int64_t stride) {
    const int64_t blocks = K / 32, mins = kind == 0 ? blocks : 2 * blocks;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_rows<4>(kind, wq, ws, xq + m * K, dx + m * blocks, K, blocks, out + m * stride, stride);
    for (; m < M; ++m) dot_rows<1>(kind, wq, ws, xq + m * K, dx + m * blocks, K, blocks, out + m * stride, stride);
    if (wmin != nullptr)
        for (m = 0; m < M; ++m) out[m * stride] += dot_f32(wmin, fmin + m * mins, mins);
}

// u4 weights in panels of 16 output rows (gguf_cpu.py `with_panels`, tf_repack_panels): per panel
// and block of 32, four 64-byte vectors -- vector v, lane i (4 bytes), byte j holds the code of the
// panel's row i at element 4v + j (low nibble) and 16 + 4v + j (high nibble) -- then the panel's
// scales and mins, [blocks][16] floats each. Why: with one lane per output row, a block's 8 VNNI dot
// products (4 elements each against the activation row's 4 bytes broadcast) complete 16 outputs'
// integer sums before the one float scale-and-add per block the format needs; the row-at-a-time
// kernels (matmul_row) paid that float work, and the lane shuffles for it, per pair of blocks per
// (activation row, output). A 32-row step's projections ran 3.3-4.1x faster (one Zen-4 core).
constexpr int64_t kPanel = 16;

#if TF_AVX512
template <int R>
inline void panel_rows(const uint8_t* pq, const float* ps, const float* pm, int64_t K, const int8_t* xq,
                       const float* dx, const float* f32, float* out, int64_t stride) {
    const int64_t blocks = K / 32;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i w[8];                                   // w[g]: elements 4g..4g+3 of the block, per row
        for (int v = 0; v < 4; ++v) {
            const __m512i raw = _mm512_loadu_si512(pq + b * 256 + v * 64);
            w[v] = _mm512_and_si512(raw, low);
            w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        const __m512 s = _mm512_loadu_ps(ps + b * kPanel);
        for (int r = 0; r < R; ++r) {
            const int32_t* x = reinterpret_cast<const int32_t*>(xq + r * K + 32 * b);
            __m512i isum = _mm512_setzero_si512();
            for (int g = 0; g < 8; ++g) isum = _mm512_dpbusd_epi32(isum, w[g], _mm512_set1_epi32(x[g]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s, _mm512_set1_ps(dx[r * blocks + b])),
                                     acc[r]);
            if (pm != nullptr)
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(pm + b * kPanel), _mm512_set1_ps(f32[r * blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
}
#endif

// One panel (16 outputs) against M activation rows: out[m * stride + i], i < 16. `pm` null: no
// mins; `f32` the activations' dx * code sum per 32. Only built where TF_AVX512 (tf_has_panels).
inline void matmul_panel(const uint8_t* pq, const float* ps, const float* pm, int64_t K, const int8_t* xq,
                         const float* dx, const float* f32, int64_t M, float* out, int64_t stride) {
#if TF_AVX512
    const int64_t blocks = K / 32;
    int64_t m = 0;
    for (; m + 8 <= M; m += 8)
        panel_rows<8>(pq, ps, pm, K, xq + m * K, dx + m * blocks, f32 + m * blocks, out + m * stride, stride);
    if (m + 4 <= M) {
        panel_rows<4>(pq, ps, pm, K, xq + m * K, dx + m * blocks, f32 + m * blocks, out + m * stride, stride);
        m += 4;
    }
    for (; m < M; ++m)
        panel_rows<1>(pq, ps, pm, K, xq + m * K, dx + m * blocks, f32 + m * blocks, out + m * stride, stride);
#else
    (void)pq, (void)ps, (void)pm, (void)K, (void)xq, (void)dx, (void)f32, (void)M, (void)out, (void)stride;
#endif
}

}  // namespace tf
