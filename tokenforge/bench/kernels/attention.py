"""Kernel micro-benchmark: decode/prefill attention and the fused ops at Llama-3.1-8B shapes.

In: an output folder. Out: `kernels.json` there (ceilings, every timing, achieved GB/s or
TFLOP/s) and a short table on stdout. Run: `tokenforge bench kernels --out OUT_DIR`
(`--part gemv`: only the small-M GEMV table and the whole decode step, from gemv.py).

Method (shared/BENCHMARKING.md): the HBM read ceiling is measured in the same run; each case is
warmed up (Triton compiles outside the timing), captured in a CUDA graph and replayed, and the
median of the replays is reported. Memory-bound cases rotate over enough copies of their inputs
(one KV cache per "layer") that the data is well beyond the 60 MB L2, as in a real decode step
where the weights evict the KV between layers. `smoke=True` runs tiny shapes on the CPU through
Triton's interpreter (TRITON_INTERPRET=1) to check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenforge.bench.kernels.common import (
    BS, DT, HIDDEN, HKV, HQ, INTER, D, guarded, layers_for, paged_caches, print_table, save_result, start_run, time_call,
)
from tokenforge.bench.kernels.gemv import bench_full_decode_step
from tokenforge.kernels._triton import set_pdl
from tokenforge.kernels.activation import silu_and_mul
from tokenforge.kernels.kv_store import store_kv
from tokenforge.kernels.paged_attention import choose_num_splits, decode_attention, prefill_attention
from tokenforge.kernels.rms_norm import fused_add_rms_norm, rms_norm
from tokenforge.kernels.rotary import apply_rotary, build_rope_cache

def bench_decode(batch: int, ctx: int, variants: dict[str, dict], device, bw: float, max_layers: int) -> list[dict]:
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    layers = layers_for(kv_bytes, cap=max_layers)
    caches, tables = paged_caches(batch, ctx, layers, device)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, D, dtype=DT, device=device)
    out = torch.empty_like(q)
    rows = []
    for name, kw in variants.items():
        kw = dict(kw)
        pdl = kw.pop("_pdl", None)

        def run(kw=kw):
            for cache in caches:
                decode_attention(q, cache, tables, seq_lens, D ** -0.5, out=out, **kw)
        try:
            set_pdl(pdl)
            sec = time_call(run, device) / layers
        except Exception as exc:  # noqa: BLE001
            print(f"ERROR decode B={batch} ctx={ctx} {name}: {exc!r}", flush=True)
            continue
        finally:
            set_pdl(None)
        rows.append({"batch": batch, "ctx": ctx, "variant": name, "kwargs": kw, "layers": layers,
                     "us": sec * 1e6, "GBps": kv_bytes / sec / 1e9, "frac_of_read_bw": kv_bytes / sec / bw})
    del caches
    return rows


def _prefill_flops(ctx_lens: list[int], q_lens: list[int]) -> float:
    # QK^T and PV: 2 * 2 * D FLOPs per (query head, visible key) pair
    pairs = sum(q * c + q * (q + 1) / 2 for c, q in zip(ctx_lens, q_lens))
    return 4 * HQ * D * pairs


def bench_prefill(name: str, ctx_lens: list[int], q_lens: list[int], configs: dict, device) -> list[dict]:
    seq_lens_l = [c + q for c, q in zip(ctx_lens, q_lens)]
    per_seq = max(-(-s // BS) for s in seq_lens_l)
    caches, tables = paged_caches(len(q_lens), per_seq * BS, 1, device)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32, device=device)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), HQ, D, dtype=DT, device=device)
    flops = _prefill_flops(ctx_lens, q_lens)
    rows = []
    for cname, cfg in configs.items():
        try:
            sec = time_call(lambda cfg=cfg: prefill_attention(q, caches[0], tables, qsl, seq_lens, D ** -0.5,
                                                              max_query_len=max(q_lens), config=cfg), device)
        except Exception as exc:  # noqa: BLE001
            print(f"ERROR prefill {name} {cname}: {exc!r}", flush=True)
            continue
        rows.append({"case": name, "config": cname, "us": sec * 1e6, "TFLOPs": flops / sec / 1e12})
    if device.type == "cuda" and all(c == 0 for c in ctx_lens) and len(set(q_lens)) == 1:
        b, s = len(q_lens), q_lens[0]                            # peer: torch SDPA on dense K/V
        qd = torch.randn(b, HQ, s, D, dtype=DT, device=device)
        kd = torch.randn(b, HQ, s, D, dtype=DT, device=device)
        vd = torch.randn(b, HQ, s, D, dtype=DT, device=device)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        sec = time_call(lambda: sdpa(qd, kd, vd, is_causal=True), device)
        rows.append({"case": name, "config": "torch_sdpa_dense", "us": sec * 1e6, "TFLOPs": flops / sec / 1e12})
    return rows


def _op_cases(tokens: int, device) -> dict[str, tuple[Callable[[], Callable[[], None]], int]]:
    """name -> (factory making a fresh input set and returning its call, bytes moved per call)."""
    cos_sin = build_rope_cache(D, 8192, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                               device=device)
    w = torch.randn(HIDDEN, dtype=DT, device=device)

    def norm():
        x = torch.randn(tokens, HIDDEN, dtype=DT, device=device)
        return lambda: rms_norm(x, w, 1e-5, out=x)

    def add_norm():
        x, r = (torch.randn(tokens, HIDDEN, dtype=DT, device=device) for _ in range(2))
        return lambda: fused_add_rms_norm(x, r, w, 1e-5, out=x)

    def torch_add_norm():
        x, r = (torch.randn(tokens, HIDDEN, dtype=DT, device=device) for _ in range(2))

        def run():
            h = x + r
            hf = h.float()
            return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(DT)
        return run

    def rope_store():
        qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, dtype=DT, device=device)
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, k, v = q.view(tokens, HQ, D), k.view(tokens, HKV, D), v.view(tokens, HKV, D)
        pos = torch.randint(0, 8192, (tokens,), device=device)
        kv = torch.randn(2, -(-tokens // BS) + 1, BS, HKV, D, dtype=DT, device=device)
        slots = torch.arange(tokens, dtype=torch.int32, device=device)
        return lambda: apply_rotary(q, k, pos, cos_sin, v=v, kv_cache=kv, slot_mapping=slots)

    def kv_store():
        k, v = (torch.randn(tokens, HKV, D, dtype=DT, device=device) for _ in range(2))
        kv = torch.randn(2, -(-tokens // BS) + 1, BS, HKV, D, dtype=DT, device=device)
        slots = torch.arange(tokens, dtype=torch.int32, device=device)
        return lambda: store_kv(k, v, kv, slots)

    def silu():
        x = torch.randn(tokens, 2 * INTER, dtype=DT, device=device)
        out = torch.empty(tokens, INTER, dtype=DT, device=device)
        return lambda: silu_and_mul(x, out=out)

    def torch_silu():
        x = torch.randn(tokens, 2 * INTER, dtype=DT, device=device)
        return lambda: torch.nn.functional.silu(x[:, :INTER]) * x[:, INTER:]

    th, tq, tkv = tokens * HIDDEN * 2, tokens * HQ * D * 2, tokens * HKV * D * 2
    return {
        "rms_norm": (norm, 2 * th), "fused_add_rms_norm": (add_norm, 4 * th),
        "torch_add_rms_norm": (torch_add_norm, 3 * th),
        "rotary+kv_store": (rope_store, 2 * tq + 2 * tkv + 3 * tkv), "kv_store": (kv_store, 4 * tkv),
        "silu_and_mul": (silu, 3 * tokens * INTER * 2), "torch_silu_mul": (torch_silu, 3 * tokens * INTER * 2),
    }


def bench_ops(tokens: int, device, bw: float, pdl: bool | None = None) -> list[dict]:
    set_pdl(pdl)
    try:
        return _bench_ops(tokens, device, bw, "" if pdl is None else f",pdl={pdl}")
    finally:
        set_pdl(None)


def _bench_ops(tokens: int, device, bw: float, tag: str) -> list[dict]:
    rows = []
    for name, (factory, nbytes) in _op_cases(tokens, device).items():
        sets = [factory() for _ in range(max(2, min(64, layers_for(nbytes, 256 * 2**20))))]

        def run(sets=sets):
            for call in sets:
                call()
        try:
            sec = time_call(run, device) / len(sets)
        except Exception as exc:  # noqa: BLE001
            print(f"ERROR op {name} T={tokens}: {exc!r}", flush=True)
            continue
        rows.append({"op": name + tag, "tokens": tokens, "us": sec * 1e6, "GBps": nbytes / sec / 1e9,
                     "frac_of_read_bw": nbytes / sec / bw})
    return rows


def bench_decode_step(ctx: int, device, layers: int = 32) -> list[dict]:
    """Every non-GEMM kernel of a batch-1 Llama-3.1-8B decode step, 32 layers, one graph."""
    caches, tables = paged_caches(1, ctx + 1, layers, device)
    seq_lens = torch.full((1,), ctx + 1, dtype=torch.int32, device=device)
    cos_sin = build_rope_cache(D, 8192, 500000.0, device=device)
    w = torch.randn(HIDDEN, dtype=DT, device=device)
    x, res = torch.randn(1, HIDDEN, dtype=DT, device=device), torch.randn(1, HIDDEN, dtype=DT, device=device)
    qkv = torch.randn(1, (HQ + 2 * HKV) * D, dtype=DT, device=device)
    q, k, v = (t.view(1, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
    gate_up = torch.randn(1, 2 * INTER, dtype=DT, device=device)
    pos, slots = torch.tensor([ctx], device=device), torch.tensor([ctx], dtype=torch.int32, device=device)
    variants = {"no_attention": None, "default": {}}
    rows = []
    for (name, kw), pdl in [(v, p) for p in (None, False) for v in variants.items()]:
        name = name + ("" if pdl is None else ",pdl_off")
        def step(kw=kw):
            for cache in caches:
                fused_add_rms_norm(x, res, w, 1e-5, out=x)
                apply_rotary(q, k, pos, cos_sin, v=v, kv_cache=cache, slot_mapping=slots)
                if kw is not None:
                    decode_attention(q, cache, tables, seq_lens, D ** -0.5, **kw)
                fused_add_rms_norm(x, res, w, 1e-5, out=x)
                silu_and_mul(gate_up)
        set_pdl(pdl)
        try:
            sec = time_call(step, device)
        finally:
            set_pdl(None)
        rows.append({"ctx": ctx, "variant": name, "layers": layers, "us_per_token": sec * 1e6})
    return rows


def run(out_dir: str, smoke: bool = False) -> dict:
    """The attention, fused-op and decode-step tables into OUT/kernels.json."""
    device, bw, result = start_run(out_dir, smoke)
    result |= {"decode": [], "prefill": [], "ops": []}
    bw = bw if not smoke else 1.0
    ctxs, batches = ([64], [1, 4]) if smoke else ([384, 512, 4096], [1, 256])
    for batch in batches:
        splits = choose_num_splits(batch, HKV, device)
        variants = {"default": {}, "pdl_off": {"_pdl": False}}
        variants |= {"n32": {"block_n": 32}, "splits=16": {"num_splits": 16}} if batch == 1 else {"n128": {"block_n": 128}}
        for ctx in ctxs:
            result["decode"] += guarded(lambda: bench_decode(batch, ctx, variants, device, bw, 4 if smoke else 128),
                                        f"decode B={batch} ctx={ctx}")
            result["decode"][-1]["heuristic_splits"] = splits
            save_result(out_dir, result)
    cfgs = {"default": None, "q32_n64_w8_s3": (32, 64, 8, 3), "q16_n32_w4_s2": (16, 32, 4, 2)}
    prefill_cases = ([("1x64", [0], [64])] if smoke else
                     [("1x2048", [0], [2048]), ("8x512", [0] * 8, [512] * 8), ("chunk512_ctx3584", [3584], [512])])
    for name, ctx_l, q_l in prefill_cases:
        result["prefill"] += guarded(lambda: bench_prefill(name, ctx_l, q_l, cfgs, device), f"prefill {name}")
        save_result(out_dir, result)
    for tokens in ([1, 3] if smoke else [1, 256, 2048]):
        result["ops"] += guarded(lambda: bench_ops(tokens, device, bw), f"ops T={tokens}")
    result["ops"] += guarded(lambda: bench_ops(1, device, bw, pdl=False), "ops T=1 pdl off")
    result["decode_step_full"] = guarded(lambda: bench_full_decode_step(64 if smoke else 384, device,
                                                                          2 if smoke else 32), "full step")
    save_result(out_dir, result)
    result["decode_step_nongemm"] = guarded(lambda: bench_decode_step(64 if smoke else 384, device, 2 if smoke else 32),
                                            "decode step")
    save_result(out_dir, result)
    print_table(result)
    return result


