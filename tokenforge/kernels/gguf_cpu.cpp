// GGUF weights computed in their stored block format on the CPU, as llama.cpp does: activations
// quantized per block of 32 to int8, integer dot products (AVX2 maddubs, or VNNI dpbusd where the
// CPU has it; AVX-512 VNNI takes two blocks per instruction), one float multiply-add per block. Built at first use by kernels/gguf_cpu.py
// (g++ -O3 -march=native -fopenmp) and called through ctypes; gguf_cpu.py holds the torch
// reference these loops must match.
//
// Two weight formats cover the six GGUF types (gguf_cpu.py repacks them, losslessly):
//   u4: 4-bit codes, blocks of 32 (byte j: element j low nibble, j+16 high), a float scale per
//       32 (Q4_0, Q4_1, Q4_K);
//   i8: 8-bit signed codes, a float scale per 16 (Q8_0, Q5_K, Q6_K);
// and a float min per scale (w = scale * q + min), absent (null) for Q8_0, Q5_0 and Q6_K.
// Activations: xq int8 [M, K], dx float [M, K/32] (amax / 127), fx float [M, K/16] (dx times the
// sum of the 16 codes: what a min multiplies, so the min term is one float dot per row).
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

namespace {

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

}  // namespace

extern "C" {

// x [M, K] float32 -> xq int8 [M, K], dx float [M, K/32], fx float [M, K/16]. K % 32 == 0.
void tf_quantize_activations(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* fx) {
    const int64_t blocks = K / 32;
#pragma omp parallel for if (M * K >= 65536)
    for (int64_t i = 0; i < M * blocks; ++i) quantize_block(x + 32 * i, xq + 32 * i, dx + i, fx + 2 * i);
}

// The add + RMSNorm before a projection, quantized for it: h = x (+ residual, the sum written to
// residual_out), y = weight * (h * rsqrt(mean(h^2) + eps)), then y as tf_quantize_activations
// quantizes it. residual and residual_out may be null (no add).
void tf_rms_norm_quantize(const float* x, const float* residual, float* residual_out, const float* weight, float eps,
                          int64_t M, int64_t K, int8_t* xq, float* dx, float* fx) {
#pragma omp parallel for if (M >= 16)
    for (int64_t m = 0; m < M; ++m) {
        float row[kMaxRow];
        const float* h = x + m * K;
        if (residual != nullptr) {
            float* sum = residual_out + m * K;
            for (int64_t j = 0; j < K; ++j) sum[j] = h[j] + residual[m * K + j];
            h = sum;
        }
        const float inv = 1.f / std::sqrt(dot_f32(h, h, K) / static_cast<float>(K) + eps);
        for (int64_t j = 0; j < K; ++j) row[j] = weight[j] * (h[j] * inv);
        for (int64_t b = 0; b < K / 32; ++b)
            quantize_block(row + 32 * b, xq + m * K + 32 * b, dx + m * (K / 32) + b, fx + m * (K / 16) + 2 * b);
    }
}

// The SwiGLU before a projection, quantized for it: gate_up [M, 2K] = [gate | up] ->
// silu(gate) * up [M, K] as tf_quantize_activations quantizes it.
void tf_silu_mul_quantize(const float* gate_up, int64_t M, int64_t K, int8_t* xq, float* dx, float* fx) {
#pragma omp parallel for if (M >= 16)
    for (int64_t m = 0; m < M; ++m) {
        float row[kMaxRow];
        const float* g = gate_up + m * 2 * K;
        const float* u = g + K;
        for (int64_t j = 0; j < K; ++j) row[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
        for (int64_t b = 0; b < K / 32; ++b)
            quantize_block(row + 32 * b, xq + m * K + 32 * b, dx + m * (K / 32) + b, fx + m * (K / 16) + 2 * b);
    }
}

// out [M, N] = x . W^T for a u4 (kind 0) or i8 (kind 1) weight of N rows and K inputs; minv may be null.
void tf_gguf_matmul(int kind, const void* q, const float* scale, const float* minv, int64_t N, int64_t K,
                    const int8_t* xq, const float* dx, const float* fx, int64_t M, float* out) {
    const int64_t blocks = K / 32, row_bytes = kind == 0 ? K / 2 : K;
    const int64_t scales = kind == 0 ? blocks : 2 * blocks;
    // u4 has one min per 32: what it multiplies is the sum of the two halves' dx * sum(codes)
    std::vector<float> fx32(kind == 0 && minv != nullptr ? M * blocks : 0);
    for (int64_t i = 0; i < static_cast<int64_t>(fx32.size()); ++i) fx32[i] = fx[2 * i] + fx[2 * i + 1];
    const float* fmin = kind == 0 ? fx32.data() : fx;
    const int64_t mins = kind == 0 ? blocks : 2 * blocks;
#pragma omp parallel for schedule(static) if (N >= 64)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* wq = static_cast<const uint8_t*>(q) + n * row_bytes;
        const float* ws = scale + n * scales;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) dot_rows<4>(kind, wq, ws, xq + m * K, dx + m * blocks, K, blocks, out + m * N + n, N);
        for (; m < M; ++m) dot_rows<1>(kind, wq, ws, xq + m * K, dx + m * blocks, K, blocks, out + m * N + n, N);
        if (minv != nullptr)
            for (m = 0; m < M; ++m) out[m * N + n] += dot_f32(minv + n * mins, fmin + m * mins, mins);
    }
}

}  // extern "C"
