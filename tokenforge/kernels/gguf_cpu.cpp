// GGUF weights computed in their stored block format on the CPU, as llama.cpp does: activations
// quantized per block of 32 to int8, integer dot products (AVX2 maddubs, or VNNI dpbusd where the
// CPU has it), one float multiply-add per block. Built at first use by kernels/gguf_cpu.py
// (g++ -O3 -march=native -fopenmp) and called through ctypes; gguf_cpu.py holds the torch
// reference these loops must match.
//
// Two weight formats cover the six GGUF types (gguf_cpu.py repacks them, losslessly):
//   u4: 4-bit codes, blocks of 32 (byte j: element j low nibble, j+16 high), per block a float
//       scale and min: w = scale * q + min (Q4_0, Q4_1, Q4_K).
//   i8: 8-bit signed codes, sub-blocks of 16, per sub-block a float scale and min
//       (Q8_0, Q5_K, Q6_K).
// Activations: xq int8 [M, K], dx float [M, K/32] (amax / 127), xsum int32 [M, K/16].
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace {

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

// One output: weight row (u4) . activation row.
inline float dot_u4(const uint8_t* qs, const float* scale, const float* minv, const int8_t* xq, const float* dx,
                    const int32_t* xsum, int64_t blocks) {
    float acc_min = 0.f;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
        __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * b));
        __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low), _mm_and_si128(packed, low));
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q, x)), _mm256_set1_ps(dx[b] * scale[b]), acc);
        acc_min += dx[b] * minv[b] * static_cast<float>(xsum[2 * b] + xsum[2 * b + 1]);
    }
    return hsum(acc) + acc_min;
#else
    float acc = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
        int32_t s = 0;
        for (int j = 0; j < 16; ++j)
            s += (qs[16 * b + j] & 0x0F) * xq[32 * b + j] + (qs[16 * b + j] >> 4) * xq[32 * b + 16 + j];
        acc += dx[b] * scale[b] * static_cast<float>(s);
        acc_min += dx[b] * minv[b] * static_cast<float>(xsum[2 * b] + xsum[2 * b + 1]);
    }
    return acc + acc_min;
#endif
}

// One output: weight row (i8, sub-blocks of 16) . activation row.
inline float dot_i8(const int8_t* q, const float* scale, const float* minv, const int8_t* xq, const float* dx,
                    const int32_t* xsum, int64_t blocks) {
    float acc_min = 0.f;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b));
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * b));
        // |w| (unsigned) times x carrying w's sign: the signed product through an unsigned-signed dot.
        __m256i sums = dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));  // lanes 0-3: first 16
        __m256 s = _mm256_set_m128(_mm_set1_ps(dx[b] * scale[2 * b + 1]), _mm_set1_ps(dx[b] * scale[2 * b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), s, acc);
        acc_min += dx[b] * (minv[2 * b] * static_cast<float>(xsum[2 * b]) +
                            minv[2 * b + 1] * static_cast<float>(xsum[2 * b + 1]));
    }
    return hsum(acc) + acc_min;
#else
    float acc = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
        for (int h = 0; h < 2; ++h) {
            int32_t s = 0;
            for (int j = 0; j < 16; ++j) s += q[32 * b + 16 * h + j] * xq[32 * b + 16 * h + j];
            acc += dx[b] * scale[2 * b + h] * static_cast<float>(s);
            acc_min += dx[b] * minv[2 * b + h] * static_cast<float>(xsum[2 * b + h]);
        }
    }
    return acc + acc_min;
#endif
}

}  // namespace

extern "C" {

// x [M, K] float32 -> xq int8 [M, K], dx float [M, K/32], xsum int32 [M, K/16]. K % 32 == 0.
void tf_quantize_activations(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, int32_t* xsum) {
    const int64_t blocks = K / 32;
#pragma omp parallel for if (M * K >= 65536)
    for (int64_t i = 0; i < M * blocks; ++i) {
        const float* v = x + 32 * i;
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(v[j]));
        const float d = amax / 127.f;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        dx[i] = d;
        int32_t s0 = 0, s1 = 0;
        for (int j = 0; j < 32; ++j) {
            const int8_t q = static_cast<int8_t>(std::nearbyint(v[j] * inv));
            xq[32 * i + j] = q;
            (j < 16 ? s0 : s1) += q;
        }
        xsum[2 * i] = s0;
        xsum[2 * i + 1] = s1;
    }
}

// out [M, N] = x . W^T for a u4 (kind 0) or i8 (kind 1) weight of N rows and K inputs.
void tf_gguf_matmul(int kind, const void* q, const float* scale, const float* minv, int64_t N, int64_t K,
                    const int8_t* xq, const float* dx, const int32_t* xsum, int64_t M, float* out) {
    const int64_t blocks = K / 32, row_bytes = kind == 0 ? K / 2 : K;
    const int64_t groups = kind == 0 ? blocks : 2 * blocks;
#pragma omp parallel for schedule(static) if (N >= 64)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* wq = static_cast<const uint8_t*>(q) + n * row_bytes;
        const float* ws = scale + n * groups;
        const float* wm = minv + n * groups;
        for (int64_t m = 0; m < M; ++m) {
            const int8_t* xr = xq + m * K;
            const float* dr = dx + m * blocks;
            const int32_t* sr = xsum + m * 2 * blocks;
            out[m * N + n] = kind == 0 ? dot_u4(wq, ws, wm, xr, dr, sr, blocks)
                                       : dot_i8(reinterpret_cast<const int8_t*>(wq), ws, wm, xr, dr, sr, blocks);
        }
    }
}

}  // extern "C"
