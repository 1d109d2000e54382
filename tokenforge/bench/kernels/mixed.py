"""Kernel micro-benchmark: a mixed step's attention (decodes beside a prefill chunk), 8B shapes.

In: an output folder. Out: `kernels_mixed.json` there and a table on stdout. Run:
`tokenforge bench kernels --part mixed --out OUT`.

A chunked-prefill step at serving load holds hundreds of decodes (one query each, long contexts)
beside a prompt chunk. Two ways to run its attention, per layer: the varlen prefill kernel over
every row (what the Triton backend did before 2026-12-06), and the backend's split (the leading
one-query rows through the split-KV decode kernel, the chunk through the prefill kernel).
Each is timed as one layer's call, graph-replayed over enough KV caches that the KV is read from
HBM, and put against its floor: the decode rows' KV bytes at the measured read rate plus the
chunk's causal FLOPs at the measured matmul rate (shared/BENCHMARKING.md).
"""

from __future__ import annotations

import torch

from tokenforge.bench.kernels.common import BS, DT, HKV, HQ, D, guarded, save_result, start_run, time_call
from tokenforge.bench.lib.ceilings import gpu_matmul_tflops
from tokenforge.kernels.paged_attention import prefill_attention
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.attention.triton_backend import TritonAttentionBackend


def bench_mixed(decodes: int, ctx: int, chunk: int, chunk_ctx: int, device, bw: float, flops: float,
                layers: int) -> list[dict]:
    q_lens = [1] * decodes + [chunk]
    ctx_lens = [ctx - 1] * decodes + [chunk_ctx]
    tables, used = [], 0
    for q, c in zip(q_lens, ctx_lens):
        n = -(-(q + c) // BS)
        tables.append(list(range(used, used + n)))
        used += n
    perm = torch.randperm(used).tolist()                    # blocks scattered over the pool
    tables = [[perm[b] for b in t] for t in tables]
    backend = TritonAttentionBackend()
    meta = backend.build_metadata(AttentionBatch(q_lens, ctx_lens, tables, BS, device))
    caches = [torch.randn(2, used, BS, HKV, D, dtype=DT, device=device) for _ in range(layers)]
    q = torch.randn(sum(q_lens), HQ, D, dtype=DT, device=device)
    kv_bytes = decodes * ctx * 2 * HKV * D * q.element_size()
    chunk_flops = 4 * HQ * D * chunk * (chunk_ctx + (chunk + 1) / 2)
    floor = kv_bytes / bw + chunk_flops / flops
    rows = []

    def one_kernel():
        for cache in caches:
            prefill_attention(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, D ** -0.5,
                              max_query_len=meta.max_query_len)

    def split():
        for cache in caches:
            backend.forward(q, q[:, :HKV], q[:, :HKV], cache, meta, D ** -0.5, kv_stored=True)

    for name, fn in (("prefill_kernel_all_rows", one_kernel), ("decode_rows_split", split)):
        sec = time_call(fn, device) / layers
        rows.append({"case": f"{decodes} decodes x ctx {ctx} + chunk {chunk} over {chunk_ctx}", "variant": name,
                     "us": sec * 1e6, "floor_us": floor * 1e6, "of_floor": floor / sec})
        print(f"{rows[-1]['case']:<44} {name:<24} {sec * 1e6:9.1f} us  floor {floor * 1e6:8.1f}  "
              f"{100 * floor / sec:5.1f}%", flush=True)
    return rows


def run(out_dir: str, smoke: bool = False) -> dict:
    device, bw, result = start_run(out_dir, smoke, " --part mixed")
    bw = 1e12 if smoke else bw
    flops = 1e12 if smoke else gpu_matmul_tflops() * 1e12
    result |= {"matmul_tflops": flops / 1e12, "mixed": []}
    cases = [(3, 64, 16, 0)] if smoke else [(300, 1536, 1024, 0), (300, 1536, 512, 512), (64, 1024, 1024, 0),
                                             (16, 2048, 2048, 0)]
    for decodes, ctx, chunk, chunk_ctx in cases:
        layers = 1 if smoke else max(2, min(32, int(2e9 // max(1, decodes * ctx * 2 * HKV * D * 2))))
        result["mixed"] += guarded(lambda: bench_mixed(decodes, ctx, chunk, chunk_ctx, device, bw, flops, layers),
                                   f"mixed {decodes}x{ctx}+{chunk}")
        save_result(out_dir, result, "kernels_mixed.json")
    return result
