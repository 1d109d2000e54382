// A whole decode step of a Llama-family decoder whose linears are GGUF blocks, in one call: for
// each layer, add + RMSNorm and 8-bit quantization, q|k|v, rotary, the new k/v stored into the
// paged KV cache, attention over the cache (read in place through the block tables), o, add +
// RMSNorm, gate|up, SwiGLU, down; then the final norm. It is the same computation as the model's
// per-op forward on the gguf-native method (gguf_cpu.cpp's kernels on the same quantized
// activations), with attention computed here in float32 instead of by SDPA. Why one call: at
// batch 1 the per-op path spends more time dispatching about 300 small torch ops and ctypes calls
// per token than in the matmuls. Everything runs in one OpenMP parallel region: projections are
// split over weight rows and attention over rows, with a barrier after each (six a
// layer, one after the KV stores); each thread keeps its own residual stream and quantized activations, which it computes
// itself between them (cheap, and a barrier fewer each time).
// Called by kernels/gguf_decode.py, whose ctypes structures mirror the ones below.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gguf_kernels.h"

using namespace tf;

extern "C" {

struct TfPart {             // one packed weight: `rows` consecutive output features, in panels
    const uint8_t* q;       // the codes (gguf_kernels.h)
    const float* scale;
    const float* minv;      // null: no min term (Q8_0, Q5_0, Q6_K)
    int64_t rows;
    int64_t kind;           // 0: u4, 1: i8
};

struct TfLinear {
    TfPart parts[4];        // a Q4_K_M layer mixes types: one part per run of a layout
    const float* bias;      // null: none
    int64_t num_parts, in_features, out_features;
};

struct TfLayer {
    const float* attn_norm;
    const float* ffn_norm;
    TfLinear qkv, o, gate_up, down;
    float* kv_cache;        // [2, num_slots, Hkv, D]
    int64_t num_slots;      // num_blocks * block_size
    int64_t window;         // sliding window; 0: full attention
};

struct TfModel {
    const TfLayer* layers;
    const float* final_norm;
    const float* cos_sin;   // [max_positions, D]: cos | sin (rotate-half layout)
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
};

struct TfStep {
    const int64_t* positions;       // [M] the new token's position (its context length)
    const int64_t* slots;           // [M] its flat cache slot
    const int32_t* block_tables;    // [M, max_blocks]
    const int32_t* seq_lens;        // [M] context + 1
    int64_t rows, max_blocks;
    int64_t threads;                // the team's size (gguf_decode.py picks it; results do not depend on it)
    int64_t attention_chunk;        // positions per attention work item (fixed: results do not depend on threads)
};

}  // extern "C"

namespace {

struct Acts {               // activations quantized for one projection (gguf_cpu.cpp's layout)
    int8_t* xq;
    float* dx;
    int32_t* xs;            // sums of codes per 16
};

struct Shared {             // what the threads write for each other: projection outputs, attention chunks
    std::vector<float> qkv, out, gate_up;
    std::vector<float> partial;     // attention chunks' [Hq, top | sum | D], merged by each thread after

    void fit(const TfModel& md, int64_t M) {
        const int64_t q_size = md.num_heads * md.head_dim, kv_size = md.num_kv_heads * md.head_dim;
        qkv.resize(M * (q_size + 2 * kv_size));
        out.resize(M * md.hidden);
        gate_up.resize(M * 2 * md.intermediate);
    }

    void fit_chunks(const TfModel& md, int64_t chunks) { partial.resize(chunks * md.num_heads * (2 + md.head_dim)); }
};

// Each thread's own copy of the residual stream and of the quantized activations: every thread
// computes them (the same numbers) from the shared outputs, so a projection needs no barrier
// before it, only after.
struct Private {
    std::vector<float> residual, row, dx, scores, q, k;
    std::vector<int8_t> xq;
    std::vector<int32_t> xs;
    std::vector<int64_t> offsets, chunks;     // chunks: each row's first chunk (rows + 1), then (row, first position) each
    Acts acts{};

    void fit(const TfModel& md, int64_t M) {
        const int64_t widest = std::max({md.hidden, md.intermediate, md.num_heads * md.head_dim});
        residual.resize(M * md.hidden);
        row.resize(widest);
        xq.resize(M * widest);
        dx.resize(M * widest / 32);
        xs.resize(M * widest / 16);
        q.resize(md.num_heads * md.head_dim);       // a row's rotated queries
        k.resize(std::max(md.head_dim, md.num_heads));     // a new key; then each head's 1 / softmax sum
        acts = {xq.data(), dx.data(), xs.data()};
    }
};

// Row m of an activation of width K, quantized into acts (row-major [M, K]).
void quantize_row(const float* v, int64_t K, int64_t m, const Acts& a) {
    const int64_t blocks = K / 32;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t i = m * blocks + b;
        quantize_block(v + 32 * b, a.xq + m * K + 32 * b, a.dx + i, a.xs + 2 * i);
    }
}

// weight * RMSNorm(h) for one row, into `row` (what tf_rms_norm_quantize computes).
void rms_norm_row(const float* h, const float* weight, float eps, int64_t K, float* row) {
    const float inv = 1.f / std::sqrt(dot_f32(h, h, K) / static_cast<float>(K) + eps);
    for (int64_t j = 0; j < K; ++j) row[j] = weight[j] * (h[j] * inv);
}

// residual += x (first layer: residual = x), then its norm quantized for the next projection.
void add_norm_quantize(const float* x, bool first, const float* weight, float eps, int64_t M, int64_t K, Private& p) {
    for (int64_t m = 0; m < M; ++m) {
        float* r = p.residual.data() + m * K;
        const float* xm = x + m * K;
        for (int64_t j = 0; j < K; ++j) r[j] = first ? xm[j] : xm[j] + r[j];
        rms_norm_row(r, weight, eps, K, p.row.data());
        quantize_row(p.row.data(), K, m, p.acts);
    }
}

// out [M, out_features] = acts . W^T (+ bias), rows split over the threads; a barrier after.
void linear(const TfLinear& L, const Acts& a, int64_t M, float* out) {
    const int64_t K = L.in_features, blocks = K / 32, stride = L.out_features;
    int64_t col = 0;
    for (int64_t part = 0; part < L.num_parts; ++part) {
        const TfPart& w = L.parts[part];
        const int64_t bytes = panel_bytes(static_cast<int>(w.kind), blocks);
        const int64_t scales = panel_scales(static_cast<int>(w.kind), blocks);
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < (w.rows + kPanel - 1) / kPanel; ++p) {
            float* o = out + col + p * kPanel;
            const int64_t valid = std::min(kPanel, w.rows - p * kPanel);
            if ((p + 1) * kPanel < w.rows)
                prefetch_panel(static_cast<int>(w.kind), w.q + (p + 1) * bytes, w.scale + (p + 1) * scales,
                               w.minv == nullptr ? nullptr : w.minv + (p + 1) * scales, blocks);
            matmul_panel(static_cast<int>(w.kind), w.q + p * bytes, w.scale + p * scales,
                         w.minv == nullptr ? nullptr : w.minv + p * scales, K, a.xq, a.dx, a.xs, M, o, stride, valid);
            if (L.bias != nullptr)
                for (int64_t m = 0; m < M; ++m)
                    for (int64_t i = 0; i < valid; ++i) o[m * stride + i] += L.bias[col + p * kPanel + i];
        }
        col += w.rows;
    }
#pragma omp barrier
}

// Rotate-half rotary of one head vector: [x1 * cos - x2 * sin, x2 * cos + x1 * sin].
void rotate(const float* x, const float* cos, const float* sin, int64_t half, float* out) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        out[i] = x1 * cos[i] - x2 * sin[i];
        out[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

// Row m's new k (rotated) and v, KV head kvh, stored at the row's slot.
void store_kv(const TfModel& md, const TfLayer& L, const TfStep& st, int64_t m, int64_t kvh, const float* row,
              Private& p) {
    const int64_t D = md.head_dim, Hq = md.num_heads, Hkv = md.num_kv_heads;
    const float* cs = md.cos_sin + st.positions[m] * D;
    float* k_new = p.k.data();
    rotate(row + (Hq + kvh) * D, cs, cs + D / 2, D / 2, k_new);
    const float* v_new = row + (Hq + Hkv + kvh) * D;
    std::copy(k_new, k_new + D, L.kv_cache + (st.slots[m] * Hkv + kvh) * D);
    std::copy(v_new, v_new + D, L.kv_cache + ((L.num_slots + st.slots[m]) * Hkv + kvh) * D);
}


// One head's scores [n] -> their softmax weights, unnormalised (exp(score - top)); returns their
// sum, and the top score in `top`.
float softmax_unnormalised(float* s, int64_t n, float& top) {
    float total = 0.f;
    top = -INFINITY;
    for (int64_t i = 0; i < n; ++i) top = std::max(top, s[i]);
    int64_t i = 0;
#if TF_AVX512
    __m512 sum = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(top)));
        _mm512_storeu_ps(s + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; i < n; ++i) total += (s[i] = std::exp(s[i] - top));
    return total;
}

float dot_head(const float* a, const float* b, int64_t D) {
#if TF_AVX512
    if (D % 32 == 0) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        __m512 y = _mm512_mul_ps(_mm512_loadu_ps(a + 16), _mm512_loadu_ps(b + 16));
        for (int64_t d = 32; d < D; d += 32) {
            x = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), x);
            y = _mm512_fmadd_ps(_mm512_loadu_ps(a + d + 16), _mm512_loadu_ps(b + d + 16), y);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(x, y));
    }
#endif
    return dot_f32(a, b, D);
}

// Row m's attention over its positions [lo, hi), all heads: every query head rotated and scaled,
// then softmax attention over those keys, read in place through the block table (every row's new k/v
// is stored before any row attends, so rows of one sequence -- a speculative verify as decode rows --
// see the rows before them) -> part [Hq, 2 + D]: each head's top score, its sum of exp(score - top)
// and the values weighted by those, unnormalised. A row's positions (the last `window` with a sliding
// window) are cut into chunks of attention_chunk from its first, so the work spreads over the threads
// even at batch 1, and the numbers do not depend on how many there are. The KV cache outgrows the
// CPU caches, so attention streams it from memory; a position's keys (and values) for every KV head
// are one contiguous run, read once, prefetched kAhead positions early (per KV head, strided, it ran
// at a third of the read rate).
void attend_chunk(const TfModel& md, const TfLayer& L, const TfStep& st, int64_t m, int64_t lo, int64_t hi,
                  const float* row, float* part, Private& p) {
    constexpr int64_t kAhead = 4;
    const int64_t D = md.head_dim, Hq = md.num_heads, group = Hq / md.num_kv_heads, width = md.num_kv_heads * D;
    const int64_t len = st.seq_lens[m], n = hi - lo;
    const int32_t* table = st.block_tables + m * st.max_blocks;
    const int64_t bs = md.block_size;
    p.offsets.resize(n + kAhead);
    for (int64_t pos = lo; pos < hi; ++pos)           // float offset of the position's keys
        p.offsets[pos - lo] = (pos == len - 1 ? st.slots[m] : table[pos / bs] * bs + pos % bs) * width;
    std::fill(p.offsets.begin() + n, p.offsets.end(), p.offsets[n - 1]);
    const float* keys = L.kv_cache;
    const float* values = L.kv_cache + L.num_slots * width;
    const float* cs = md.cos_sin + st.positions[m] * D;
    float* q = p.q.data();
    for (int64_t h = 0; h < Hq; ++h) {
        rotate(row + h * D, cs, cs + D / 2, D / 2, q + h * D);
        for (int64_t d = 0; d < D; ++d) q[h * D + d] *= md.scale;
    }
    p.scores.resize(Hq * n);
    float* s = p.scores.data();
    const int64_t* off = p.offsets.data();
    for (int64_t i = 0; i < n; ++i) {
        for (int64_t b = 0; b < width; b += 16) _mm_prefetch(reinterpret_cast<const char*>(keys + off[i + kAhead] + b), _MM_HINT_T0);
        const float* k = keys + off[i];
        for (int64_t h = 0; h < Hq; ++h) s[h * n + i] = dot_head(q + h * D, k + (h / group) * D, D);
    }
    for (int64_t h = 0; h < Hq; ++h) {
        part[h * (2 + D) + 1] = softmax_unnormalised(s + h * n, n, part[h * (2 + D)]);
        std::fill(part + h * (2 + D) + 2, part + (h + 1) * (2 + D), 0.f);
    }
    for (int64_t i = 0; i < n; ++i) {
        for (int64_t b = 0; b < width; b += 16) _mm_prefetch(reinterpret_cast<const char*>(values + off[i + kAhead] + b), _MM_HINT_T0);
        const float* v = values + off[i];
        for (int64_t h = 0; h < Hq; ++h) {
            const float w = s[h * n + i];
            const float* vh = v + (h / group) * D;
            float* o = part + h * (2 + D) + 2;
            for (int64_t d = 0; d < D; ++d) o[d] += w * vh[d];
        }
    }
}

// A row's chunks [first, first + count) merged in order -> out [Hq, D]. One chunk: its values times
// 1 / its sum, as a single pass over the row computes them.
void merge_chunks(const float* parts, int64_t count, int64_t Hq, int64_t D, float* out) {
    for (int64_t h = 0; h < Hq; ++h) {
        float* o = out + h * D;
        const float* first = parts + h * (2 + D);
        if (count == 1) {
            const float inv = 1.f / first[1];
            for (int64_t d = 0; d < D; ++d) o[d] = first[2 + d] * inv;
            continue;
        }
        float top = -INFINITY, total = 0.f;
        for (int64_t c = 0; c < count; ++c) top = std::max(top, parts[(c * Hq + h) * (2 + D)]);
        std::fill(o, o + D, 0.f);
        for (int64_t c = 0; c < count; ++c) {
            const float* part = parts + (c * Hq + h) * (2 + D);
            const float w = std::exp(part[0] - top);
            total += part[1] * w;
            for (int64_t d = 0; d < D; ++d) o[d] += part[2 + d] * w;
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
}

// The layer's attention chunks, the same list in every thread: per row the index of its first chunk
// (rows + 1 entries), then (row, first position) per chunk.
void attention_chunks(const TfLayer& L, const TfStep& st, int64_t chunk, std::vector<int64_t>& out) {
    out.assign(st.rows + 1, 0);
    for (int64_t m = 0; m < st.rows; ++m) {
        const int64_t len = st.seq_lens[m], lo = L.window > 0 ? std::max<int64_t>(0, len - L.window) : 0;
        out[m + 1] = out[m] + (len - lo + chunk - 1) / chunk;
        for (int64_t pos = lo; pos < len; pos += chunk) {
            out.push_back(m);
            out.push_back(pos);
        }
    }
}

// Every (row, KV head)'s store, then every (row, chunk of positions)'s attention, each split over the
// threads with a barrier after; each thread then merges every row's chunks itself (`merge_chunks`,
// in decode_layer), as it computes the other activations it quantizes.
void attention(const TfModel& md, const TfLayer& L, const TfStep& st, const float* qkv, Shared& sh, Private& p) {
    const int64_t D = md.head_dim, Hq = md.num_heads, Hkv = md.num_kv_heads, width = (Hq + 2 * Hkv) * D;
    const int64_t chunk = std::max<int64_t>(1, st.attention_chunk);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < st.rows * Hkv; ++i) store_kv(md, L, st, i / Hkv, i % Hkv, qkv + (i / Hkv) * width, p);
    attention_chunks(L, st, chunk, p.chunks);
    const int64_t num_chunks = p.chunks[st.rows];
    const int64_t* items = p.chunks.data() + st.rows + 1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t m = items[2 * c], lo = items[2 * c + 1];
        attend_chunk(md, L, st, m, lo, std::min(lo + chunk, static_cast<int64_t>(st.seq_lens[m])), qkv + m * width,
                     sh.partial.data() + c * Hq * (2 + D), p);
    }
}

void silu_mul_quantize(const float* gate_up, int64_t M, int64_t K, Private& p) {
    for (int64_t m = 0; m < M; ++m) {
        const float* g = gate_up + m * 2 * K;
        const float* u = g + K;
        float* row = p.row.data();
        silu_mul_row(g, u, K, row);
        quantize_row(row, K, m, p.acts);
    }
}

// One layer, run by every thread of the region: six barriers (after each projection, after the
// KV stores and after attention); the norms, SwiGLU and quantization between them each thread computes for itself.
void decode_layer(const TfModel& md, const TfLayer& L, const TfStep& st, float* hidden, bool first, Shared& s,
                  Private& p) {
    const int64_t M = st.rows, H = md.hidden, I = md.intermediate, q_size = md.num_heads * md.head_dim;
    add_norm_quantize(hidden, first, L.attn_norm, md.eps, M, H, p);
    linear(L.qkv, p.acts, M, s.qkv.data());
    attention(md, L, st, s.qkv.data(), s, p);
    for (int64_t m = 0; m < M; ++m) {
        const int64_t first = p.chunks[m], D = md.head_dim;
        merge_chunks(s.partial.data() + first * md.num_heads * (2 + D), p.chunks[m + 1] - first, md.num_heads, D,
                     p.row.data());
        quantize_row(p.row.data(), q_size, m, p.acts);
    }
    linear(L.o, p.acts, M, s.out.data());
    add_norm_quantize(s.out.data(), false, L.ffn_norm, md.eps, M, H, p);
    linear(L.gate_up, p.acts, M, s.gate_up.data());
    silu_mul_quantize(s.gate_up.data(), M, I, p);
    linear(L.down, p.acts, M, hidden);
}

Private& private_scratch(const TfModel& md, int64_t M) {
    thread_local Private p;      // called inside the region: each thread's own
    p.fit(md, M);
    return p;
}

}  // namespace

extern "C" {

// hidden [M, H]: in, the embeddings of the step's tokens; out, the final-normed hidden states.
void tf_decode_step(const TfModel* model, const TfStep* step, float* hidden) {
    const TfModel& md = *model;
    const int64_t M = step->rows, H = md.hidden;
    thread_local Shared per_caller;
    Shared& shared = per_caller;        // the calling thread's, shared by the team (a thread_local
    shared.fit(md, M);                  // named inside the region would be each thread's own)
    const int64_t chunk = std::max<int64_t>(1, step->attention_chunk);
    int64_t chunks = 0;                 // the most attention chunks a layer can have (no window)
    for (int64_t m = 0; m < M; ++m) chunks += (step->seq_lens[m] + chunk - 1) / chunk;
    shared.fit_chunks(md, chunks);
#pragma omp parallel num_threads(static_cast<int>(std::max<int64_t>(1, step->threads)))
    {
        Private& p = private_scratch(md, M);
        for (int64_t l = 0; l < md.num_layers; ++l) decode_layer(md, md.layers[l], *step, hidden, l == 0, shared, p);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            float* r = p.residual.data() + m * H;
            for (int64_t j = 0; j < H; ++j) r[j] += hidden[m * H + j];
            rms_norm_row(r, md.final_norm, md.eps, H, hidden + m * H);
        }
    }
}

}  // extern "C"
