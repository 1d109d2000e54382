// GGUF weights computed in their stored block format on the CPU, as llama.cpp does: activations
// quantized per block of 32 to int8, integer dot products on panels of 16 weight rows
// (gguf_kernels.h: AVX-512 VNNI dpbusd, else AVX2), one float multiply-add per block. Built at
// first use by kernels/gguf_cpu.py (g++ -O3 -march=native -fopenmp) and called through ctypes;
// gguf_cpu.py holds the torch reference these loops must match.
//
// Two code formats cover the eight GGUF types (gguf_repack.py repacks them, losslessly):
//   u4: 4-bit codes, a float scale per 32 (Q4_0, Q4_1, Q4_K);
//   i8: 8-bit signed codes, a float scale per 16 (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K);
// and a float min per scale (w = scale * q + min), absent (null) for Q8_0, Q5_0 and Q6_K. Both sit
// in panels (layout: gguf_kernels.h). Activations: xq int8 [M, K], dx float [M, K/32] (amax / 127),
// xs int32 [M, K/16] (the sums of 16 codes: a min multiplies dx times them).
#include <cstring>
#include <vector>

#include "gguf_kernels.h"

using namespace tf;

extern "C" {

// x [M, K] float32 -> xq int8 [M, K], dx float [M, K/32], xs int32 [M, K/16]. K % 32 == 0.
void tf_quantize_activations(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, int32_t* xs) {
    const int64_t blocks = K / 32;
#pragma omp parallel for if (M * K >= 65536)
    for (int64_t i = 0; i < M * blocks; ++i) quantize_block(x + 32 * i, xq + 32 * i, dx + i, xs + 2 * i);
}

// The add + RMSNorm before a projection, quantized for it: h = x (+ residual, the sum written to
// residual_out), y = weight * (h * rsqrt(mean(h^2) + eps)), then y as tf_quantize_activations
// quantizes it. residual and residual_out may be null (no add).
void tf_rms_norm_quantize(const float* x, const float* residual, float* residual_out, const float* weight, float eps,
                          int64_t M, int64_t K, int8_t* xq, float* dx, int32_t* xs) {
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
            quantize_block(row + 32 * b, xq + m * K + 32 * b, dx + m * (K / 32) + b, xs + m * (K / 16) + 2 * b);
    }
}

// The SwiGLU before a projection, quantized for it: gate_up [M, 2K] = [gate | up] ->
// silu(gate) * up [M, K] as tf_quantize_activations quantizes it.
void tf_silu_mul_quantize(const float* gate_up, int64_t M, int64_t K, int8_t* xq, float* dx, int32_t* xs) {
#pragma omp parallel for if (M >= 16)
    for (int64_t m = 0; m < M; ++m) {
        float row[kMaxRow];
        const float* g = gate_up + m * 2 * K;
        const float* u = g + K;
        silu_mul_row(g, u, K, row);
        for (int64_t b = 0; b < K / 32; ++b)
            quantize_block(row + 32 * b, xq + m * K + 32 * b, dx + m * (K / 32) + b, xs + m * (K / 16) + 2 * b);
    }
}

// out [M, N] = x . W^T for a weight of N rows and K inputs in panels (gguf_kernels.h): u4 (kind
// 0) or i8 (kind 1) codes `pq`, their scales `ps` and mins `pm` (null: none).
void tf_gguf_matmul(int kind, const uint8_t* pq, const float* ps, const float* pm, int64_t N, int64_t K,
                    const int8_t* xq, const float* dx, const int32_t* xs, int64_t M, float* out) {
    const int64_t blocks = K / 32, bytes = panel_bytes(kind, blocks), scales = panel_scales(kind, blocks);
    // Tiles of kTile activation rows (L2-resident, ~kTile K bytes) times every panel, tile by tile:
    // a long prefill chunk's activations no longer stream from memory once per panel.
    constexpr int64_t kTile = 64;
    const int64_t panels = (N + kPanel - 1) / kPanel, tiles = (M + kTile - 1) / kTile;
#pragma omp parallel for collapse(2) schedule(static) if (N * M >= 64)
    for (int64_t t = 0; t < tiles; ++t)
        for (int64_t p = 0; p < panels; ++p) {
            if (t == 0 && p + 1 < panels)
                prefetch_panel(kind, pq + (p + 1) * bytes, ps + (p + 1) * scales, pm == nullptr ? nullptr : pm + (p + 1) * scales,
                               blocks);
            matmul_panel(kind, pq + p * bytes, ps + p * scales, pm == nullptr ? nullptr : pm + p * scales, K,
                         xq + t * kTile * K, dx + t * kTile * blocks, xs + 2 * t * kTile * blocks,
                         std::min(kTile, M - t * kTile), out + t * kTile * N + p * kPanel, N, std::min(kPanel, N - p * kPanel));
        }
}

// Whether this build has the AVX-512 VNNI panel kernels (gguf_native picks its long-chunk path by it).
int tf_has_avx512_vnni() { return TF_AVX512; }

// A weight row by row (q: u4 uint8 [N, K/2] or i8 int8 [N, K]; scale / minv [N, K/32] or [N, K/16];
// minv may be null) -> its panels pq, ps, pm of `kind` (gguf_repack.to_panels, bit for bit; the
// last panel's rows past N zero).
void tf_repack_panels(int kind, const uint8_t* q, const float* scale, const float* minv, int64_t N, int64_t K,
                      uint8_t* pq, float* ps, float* pm) {
    // kind 2: an i8 weight whose two scales (and mins) per block are equal: the first of each pair
    const int64_t blocks = K / 32, row_bytes = kind == 0 ? K / 2 : K, groups = scale_groups(kind);
    const int64_t row_scales = kind == 0 ? blocks : 2 * blocks, step = kind == 0 ? 1 : 2;
    const int64_t bytes = panel_bytes(kind, blocks), scales = panel_scales(kind, blocks), panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) if (N * K >= 262144)
    for (int64_t p = 0; p < panels; ++p) {
        std::memset(pq + p * bytes, 0, bytes);
        std::memset(ps + p * scales, 0, scales * sizeof(float));
        if (pm != nullptr) std::memset(pm + p * scales, 0, scales * sizeof(float));
        for (int64_t i = 0; i < std::min(kPanel, N - p * kPanel); ++i) {
            const int64_t n = p * kPanel + i;
            for (int64_t b = 0; b < blocks; ++b) {
                uint8_t* dst = pq + p * bytes + b * (bytes / blocks) + i * 4;
                const uint8_t* src = q + n * row_bytes + b * (row_bytes / blocks);
                for (int v = 0; v < (kind == 0 ? 4 : 8); ++v)
                    for (int j = 0; j < 4; ++j) dst[v * 64 + j] = kind == 0 ? src[4 * v + j] : src[4 * v + j] ^ 0x80;
                for (int64_t g = 0; g < groups; ++g) {
                    const int64_t at = p * scales + (b * groups + g) * kPanel + i, from = n * row_scales + b * step + g;
                    ps[at] = scale[from];
                    if (pm != nullptr) pm[at] = minv[from];
                }
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
void dequantize(int kind, const uint8_t* pq, const float* ps, const float* pm, int64_t N, int64_t K, Out* out) {
    const int64_t blocks = K / 32, bytes = panel_bytes(kind, blocks), scales = panel_scales(kind, blocks);
#pragma omp parallel for schedule(static) if (N * K >= 262144)
    for (int64_t n = 0; n < N; ++n) {
        const int64_t p = n / kPanel, i = n % kPanel;
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* c = pq + p * bytes + b * (bytes / blocks) + i * 4;
            Out* o = out + n * K + b * 32;
            for (int half = 0; half < 2; ++half) {     // elements 16 half .. 16 half + 15
                const int64_t at = p * scales + (kind == 1 ? 2 * b + half : b) * kPanel + i;
                const float s = ps[at], mn = pm == nullptr ? 0.f : pm[at];
                for (int e = 0; e < 16; ++e) {
                    const uint8_t byte = c[(kind == 0 ? e / 4 : 4 * half + e / 4) * 64 + e % 4];
                    const int code = kind == 0 ? (half == 0 ? byte & 0x0F : byte >> 4) : static_cast<int>(byte) - 128;
                    store(s * static_cast<float>(code) + mn, o + 16 * half + e);
                }
            }
        }
    }
}

}  // namespace

extern "C" {

void tf_dequantize(int kind, const uint8_t* pq, const float* ps, const float* pm, int64_t N, int64_t K, float* out) {
    dequantize(kind, pq, ps, pm, N, K, out);
}

void tf_dequantize_bf16(int kind, const uint8_t* pq, const float* ps, const float* pm, int64_t N, int64_t K,
                        uint16_t* out) {
    dequantize(kind, pq, ps, pm, N, K, out);
}
#pragma GCC pop_options

}  // extern "C"
