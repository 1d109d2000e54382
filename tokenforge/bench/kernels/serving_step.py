"""Kernel micro-benchmark: a decode step at serving batch sizes, 8B shapes: the linears and the
decode attention over ragged contexts.

In: an output folder. Out: `kernels_serving_step.json` there and a table on stdout. Run:
`tokenforge bench kernels --part serving_step --out OUT`.

W4's decode steps (~100-300 running sequences) ran at 72-83% of their ideal time (BENCHMARKS.md,
wave 3 round 10); which part? Linears: per M, a layer's qkv, o, gate_up and down as the engine runs
them (`DenseMethod.apply`: the Triton GEMV up to its row limit, cuBLAS above), where a GEMM is
neither clearly memory- nor compute-bound (an H200's ridge is ~190 FLOP/byte), each against its
floor, the longer of reading its weights at the measured read rate and its FLOPs at the measured
matmul rate. Attention: decode batches whose contexts spread over [L, 2L) as W4's do (the
uniform-context table in attention.py hides the programs' imbalance), against reading their KV at
the read rate. Everything graph-replayed over enough layers' weights or KV caches that they come
from HBM.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.bench.kernels.common import (
    BS, DT, HIDDEN, HKV, HQ, INTER, D, guarded, layers_for, save_result, start_run, time_call,
)
from tokenforge.bench.lib.ceilings import gpu_matmul_tflops
from tokenforge.kernels.paged_attention import decode_attention
from tokenforge.model.quant.dense import DENSE

SHAPES = (("qkv", (HQ + 2 * HKV) * D, HIDDEN), ("o", HIDDEN, HQ * D), ("gate_up", 2 * INTER, HIDDEN),
          ("down", HIDDEN, INTER))


def _layer(n: int, k: int, device) -> nn.Module:
    layer = nn.Module()
    layer.weight = torch.randn(n, k, dtype=DT, device=device) * 0.02
    layer.mkl_weight = None
    return layer


def bench_rows(m: int, device, bw: float, flops: float, layers: int) -> list[dict]:
    stacks = {name: [_layer(n, k, device) for _ in range(layers)] for name, n, k in SHAPES}
    xs = {name: torch.randn(m, k, dtype=DT, device=device) for name, _, k in SHAPES}
    rows, layer_us, layer_floor = [], 0.0, 0.0
    for name, n, k in SHAPES:
        def run(name=name):
            for lin in stacks[name]:
                DENSE.apply(lin, xs[name], None)
        sec = time_call(run, device) / layers
        floor = max(n * k * 2 / bw, 2 * m * n * k / flops)
        layer_us, layer_floor = layer_us + sec * 1e6, layer_floor + floor * 1e6
        rows.append({"m": m, "linear": name, "us": sec * 1e6, "floor_us": floor * 1e6, "of_floor": floor / sec,
                     "bound": "read" if n * k * 2 / bw >= 2 * m * n * k / flops else "matmul"})
    rows.append({"m": m, "linear": "layer", "us": layer_us, "floor_us": layer_floor, "of_floor": layer_floor / layer_us})
    print(f"M={m:4d}  " + "  ".join(f"{r['linear']} {r['us']:7.1f} us ({100 * r['of_floor']:4.1f}%)" for r in rows),
          flush=True)
    return rows


def bench_ragged(batch: int, lo: int, device, bw: float, max_layers: int) -> list[dict]:
    """Decode attention over `batch` sequences of lo..2*lo - 1 keys (spread evenly, shuffled)."""
    lens = [lo + (i * lo) // batch for i in range(batch)]
    lens = [lens[i] for i in torch.randperm(batch).tolist()]
    per_seq = [-(-n // BS) for n in lens]
    kv_bytes = sum(lens) * HKV * D * 2 * 2
    layers = layers_for(kv_bytes, cap=max_layers)
    blocks = sum(per_seq)
    caches = [torch.randn(2, blocks, BS, HKV, D, dtype=DT, device=device) for _ in range(layers)]
    perm = torch.randperm(blocks).to(torch.int32)
    tables = torch.zeros(batch, max(per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[used:used + n]
        used += n
    tables = tables.to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, D, dtype=DT, device=device)
    out = torch.empty_like(q)

    def run():
        for cache in caches:
            decode_attention(q, cache, tables, seq_lens, D ** -0.5, out=out)
    sec = time_call(run, device) / layers
    row = {"batch": batch, "ctx": f"{lo}-{2 * lo - 1}", "layers": layers, "us": sec * 1e6,
           "floor_us": kv_bytes / bw * 1e6, "of_floor": kv_bytes / bw / sec}
    print(f"decode attention B={batch:4d} ctx {row['ctx']:>10}  {sec * 1e6:8.1f} us ({100 * row['of_floor']:4.1f}%)",
          flush=True)
    return [row]


def run(out_dir: str, smoke: bool = False) -> dict:
    device, bw, result = start_run(out_dir, smoke, " --part serving_step")
    bw = 1e12 if smoke else bw
    flops = 1e12 if smoke else gpu_matmul_tflops() * 1e12
    result |= {"matmul_tflops": flops / 1e12, "linears": [], "ragged_decode": []}
    ms = [1, 4] if smoke else [1, 16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    for m in ms:
        layers = 1 if smoke else 4            # 4 x 436 MB of weights: well past the L2
        result["linears"] += guarded(lambda m=m: bench_rows(m, device, bw, flops, layers), f"linears M={m}")
        save_result(out_dir, result, "kernels_serving_step.json")
    for batch, lo in ([(3, 16)] if smoke else [(64, 1024), (128, 1024), (164, 1024), (256, 1024), (300, 1024),
                                               (256, 512), (128, 2048)]):
        result["ragged_decode"] += guarded(lambda b=batch, n=lo: bench_ragged(b, n, device, bw, 1 if smoke else 64),
                                           f"ragged decode B={batch} L={lo}")
        save_result(out_dir, result, "kernels_serving_step.json")
    return result
