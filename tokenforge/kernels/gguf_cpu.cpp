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
#include <cstring>
#include <vector>

#include "gguf_kernels.h"

using namespace tf;

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

// out [M, N] = x . W^T for a u4 (kind 0) or i8 (kind 1) weight of N rows and K inputs; minv may be
// null. `pq` (null: none): the u4 weight's panels (tf_repack_panels), with their scales `ps` and mins
// `pm` (null: none); N % 16 == 0 then.
void tf_gguf_matmul(int kind, const void* q, const float* scale, const float* minv, int64_t N, int64_t K,
                    const int8_t* xq, const float* dx, const float* fx, int64_t M, float* out,
                    const uint8_t* pq, const float* ps, const float* pm) {
    const int64_t blocks = K / 32, row_bytes = kind == 0 ? K / 2 : K;
    const int64_t scales = kind == 0 ? blocks : 2 * blocks;
    // u4 has one min per 32: what it multiplies is the sum of the two halves' dx * sum(codes)
    std::vector<float> fx32(kind == 0 && (minv != nullptr || pm != nullptr) ? M * blocks : 0);
    for (int64_t i = 0; i < static_cast<int64_t>(fx32.size()); ++i) fx32[i] = fx[2 * i] + fx[2 * i + 1];
    const float* fmin = kind == 0 ? fx32.data() : fx;
    const int64_t mins = kind == 0 ? blocks : 2 * blocks;
    if (pq != nullptr) {
#pragma omp parallel for schedule(static) if (N >= 64)
        for (int64_t p = 0; p < N / kPanel; ++p)
            matmul_panel(pq + p * blocks * 256, ps + p * blocks * kPanel, pm == nullptr ? nullptr : pm + p * blocks * kPanel,
                         K, xq, dx, fmin, M, out + p * kPanel, N);
        return;
    }
#pragma omp parallel for schedule(static) if (N >= 64)
    for (int64_t n = 0; n < N; ++n)
        matmul_row(kind, static_cast<const uint8_t*>(q) + n * row_bytes, scale + n * scales,
                   minv == nullptr ? nullptr : minv + n * mins, K, xq, dx, fmin, M, out + n, N);
}

// Whether this build has the panel kernels (AVX-512 VNNI): gguf_cpu.py makes panels only then.
int tf_has_panels() { return TF_AVX512; }

// A u4 weight (q uint8 [N, K/2], scale / minv [N, K/32]; minv may be null) -> its panels: pq
// [N/16, K/32, 256] bytes, ps / pm [N/16, K/32, 16] (layout: gguf_kernels.h). N % 16 == 0.
void tf_repack_panels(const uint8_t* q, const float* scale, const float* minv, int64_t N, int64_t K, uint8_t* pq,
                      float* ps, float* pm) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static) if (N * K >= 262144)
    for (int64_t p = 0; p < N / kPanel; ++p) {
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t* dst = pq + (p * blocks + b) * 256;
            const int64_t at = (p * blocks + b) * kPanel;
            for (int64_t i = 0; i < kPanel; ++i) {
                const int64_t n = p * kPanel + i;
                for (int v = 0; v < 4; ++v) std::memcpy(dst + v * 64 + i * 4, q + n * (K / 2) + b * 16 + 4 * v, 4);
                ps[at + i] = scale[n * blocks + b];
                if (minv != nullptr) pm[at + i] = minv[n * blocks + b];
            }
        }
    }
}

// IEEE half -> float, exactly (subnormals, inf and NaN included): what torch's .float() gives.
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0 && mant == 0) {
        bits = sign;
    } else if (exp == 0) {                       // subnormal: normalise the mantissa
        uint32_t m = mant, e = 0;
        while ((m & 0x400u) == 0) { m <<= 1; ++e; }
        bits = sign | ((113u - e) << 23) | ((m & 0x3FFu) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// Q4_0 / Q4_1 / Q8_0 blocks -> gguf_repack.py's layouts in one pass (what its torch code gives,
// bit for bit): u4 codes as stored with a scale and min per 32 (Q4_0's min is -8 d), or Q8_0's
// codes with its scale twice (one per 16) and no min.
void tf_repack_legacy(int type, const uint8_t* raw, int64_t nblocks, uint8_t* q, float* scale, float* minv) {
    const int64_t block = type == 2 ? 18 : type == 3 ? 20 : 34, codes = type == 8 ? 32 : 16;
#pragma omp parallel for schedule(static) if (nblocks >= 16384)
    for (int64_t b = 0; b < nblocks; ++b) {
        const uint8_t* src = raw + b * block;
        uint16_t h[2];
        std::memcpy(h, src, sizeof h);
        const float d = half_to_float(h[0]);
        const int64_t head = type == 3 ? 4 : 2;
        std::memcpy(q + b * codes, src + head, codes);
        if (type == 8) {
            scale[2 * b] = scale[2 * b + 1] = d;
            minv[2 * b] = minv[2 * b + 1] = 0.f;
        } else {
            scale[b] = d;
            minv[b] = type == 2 ? d * -8.0f : half_to_float(h[1]);
        }
    }
}

// out [N, K] = scale * q + min: the dequantized weight for a long prefill chunk's GEMM, in one
// pass (no contraction into an FMA: the same two roundings as dequantize_packed), stored as float32
// or rounded to bfloat16 (nearest even, as torch's .to(torch.bfloat16)) for the bf16 GEMM.
}  // extern "C"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace {
inline void store(float v, float* o) { *o = v; }
inline void store(float v, uint16_t* o) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    *o = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);   // finite weights: no NaN case
}

template <class Out>
void dequantize(int kind, const void* q, const float* scale, const float* minv, int64_t N, int64_t K, Out* out) {
    const int64_t groups = kind == 0 ? K / 32 : K / 16, width = K / groups;
#pragma omp parallel for schedule(static) if (N * K >= 262144)
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t g = 0; g < groups; ++g) {
            const float s = scale[n * groups + g], mn = minv == nullptr ? 0.f : minv[n * groups + g];
            Out* o = out + n * K + g * width;
            if (kind == 0) {
                const uint8_t* c = static_cast<const uint8_t*>(q) + n * (K / 2) + g * 16;
                for (int j = 0; j < 16; ++j) {
                    store(s * static_cast<float>(c[j] & 0x0F) + mn, o + j);
                    store(s * static_cast<float>(c[j] >> 4) + mn, o + j + 16);
                }
            } else {
                const int8_t* c = static_cast<const int8_t*>(q) + n * K + g * 16;
                for (int j = 0; j < 16; ++j) store(s * static_cast<float>(c[j]) + mn, o + j);
            }
        }
    }
}

}  // namespace

extern "C" {

void tf_dequantize(int kind, const void* q, const float* scale, const float* minv, int64_t N, int64_t K, float* out) {
    dequantize(kind, q, scale, minv, N, K, out);
}

void tf_dequantize_bf16(int kind, const void* q, const float* scale, const float* minv, int64_t N, int64_t K,
                        uint16_t* out) {
    dequantize(kind, q, scale, minv, N, K, out);
}
#pragma GCC pop_options

}  // extern "C"
