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
    for (int64_t n = 0; n < N; ++n)
        matmul_row(kind, static_cast<const uint8_t*>(q) + n * row_bytes, scale + n * scales,
                   minv == nullptr ? nullptr : minv + n * mins, K, xq, dx, fmin, M, out + n, N);
}

}  // extern "C"
