"""Kernel micro-benchmark: decode/prefill attention and the fused ops at Llama-3.1-8B shapes.

In: an output folder. Out: `kernels.json` there (ceilings, every timing, achieved GB/s or
TFLOP/s) and a short table on stdout. Run: `python -m tokenforge.bench.kernels OUT_DIR`.

Method (shared/BENCHMARKING.md): the HBM read ceiling is measured in the same run; each case is
warmed up (Triton compiles outside the timing), captured in a CUDA graph and replayed, and the
median of the replays is reported. Memory-bound cases rotate over enough copies of their inputs
(one KV cache per "layer") that the data is well beyond the 60 MB L2, as in a real decode step
where the weights evict the KV between layers. `smoke=True` runs tiny shapes on the CPU through
Triton's interpreter (TRITON_INTERPRET=1) to check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenforge.kernels._triton import set_pdl
from tokenforge.kernels.activation import silu_and_mul
from tokenforge.kernels.gemv import NORM, PLAIN, SILU_MUL, GemvConfig, add_rms_norm_gemv, gemv, silu_mul_gemv
from tokenforge.kernels.kv_store import store_kv
from tokenforge.kernels.paged_attention import choose_num_splits, decode_attention, prefill_attention
from tokenforge.kernels.rms_norm import fused_add_rms_norm, rms_norm
from tokenforge.kernels.rotary import apply_rotary, build_rope_cache

HQ, HKV, D, BS, HIDDEN, INTER, VOCAB = 32, 8, 128, 16, 4096, 14336, 128256
DT = torch.bfloat16
# name -> (N, K, the prologue the model fuses into it)
GEMV_SHAPES = {"qkv": ((HQ + 2 * HKV) * D, HIDDEN, NORM), "o": (HIDDEN, HQ * D, PLAIN),
               "gate_up": (2 * INTER, HIDDEN, NORM), "down": (HIDDEN, INTER, SILU_MUL),
               "lm_head": (VOCAB, HIDDEN, PLAIN)}
GEMV_SWEEP = {1: [GemvConfig(1, bn, bk) for bn, bk in ((2, 1024), (4, 512), (4, 1024), (8, 512), (8, 1024))],
              2: [GemvConfig(2, bn, bk) for bn, bk in ((2, 1024), (4, 512), (8, 256))],
              4: [GemvConfig(4, bn, bk) for bn, bk in ((2, 512), (4, 256), (8, 128))]}


def guarded(fn: Callable[[], list[dict]], label: str) -> list[dict]:
    """Run one benchmark section; a failure becomes an error row instead of ending the run."""
    try:
        t0 = time.perf_counter()
        rows = fn()
        print(f"[{label}] {time.perf_counter() - t0:.1f}s: {json.dumps(rows)[:600]}", flush=True)
        return rows
    except Exception as exc:  # noqa: BLE001 - a broken variant must not cost the rest of the run
        print(f"ERROR in {label}: {exc!r}", flush=True)
        return [{"section": label, "error": repr(exc)[:500]}]


def time_call(fn: Callable[[], None], device: torch.device, repeats: int = 20) -> float:
    """Median seconds per call of fn, replayed as a CUDA graph (launch gaps as in the engine)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    fn(), fn()                                                   # compile + warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def hbm_read_bandwidth(device: torch.device, gib: float = 4.0) -> float:
    """Bytes/s of `x.sum(dtype=float32)` over a bf16 tensor (BENCHMARKING.md's read ceiling)."""
    x = torch.randn(int(gib * 2**30) // 2, dtype=DT, device=device)
    if device.type != "cuda":
        return float("nan")
    for _ in range(3):
        x.sum(dtype=torch.float32)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum(dtype=torch.float32)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return x.numel() * 2 / statistics.median(times)


def _layers_for(bytes_per_layer: int, target: int = 512 * 2**20, cap: int = 128) -> int:
    return max(2, min(cap, math.ceil(target / max(bytes_per_layer, 1))))


def _paged_caches(batch: int, seq_len: int, layers: int, device: torch.device):
    """`layers` random KV caches plus one shuffled block table [batch, blocks] shared by them."""
    per_seq = -(-seq_len // BS)
    num_blocks = batch * per_seq
    caches = [torch.randn(2, num_blocks, BS, HKV, D, dtype=DT, device=device) for _ in range(layers)]
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, per_seq)
    return caches, tables


def bench_decode(batch: int, ctx: int, variants: dict[str, dict], device, bw: float, max_layers: int) -> list[dict]:
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    layers = _layers_for(kv_bytes, cap=max_layers)
    caches, tables = _paged_caches(batch, ctx, layers, device)
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
    caches, tables = _paged_caches(len(q_lens), per_seq * BS, 1, device)
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
        sets = [factory() for _ in range(max(2, min(64, _layers_for(nbytes, 256 * 2**20))))]

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
    caches, tables = _paged_caches(1, ctx + 1, layers, device)
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


def bench_full_decode_step(ctx: int, device, layers: int = 32) -> list[dict]:
    """A batch-1 Llama-3.1-8B decode step with real-size weights and our kernels.

    Embedding lookup and sampling are left out. Variants: the cuBLAS GEMM walk alone; cuBLAS with
    our kernels (PDL default, and off); the fused Triton GEMVs (norm+qkv, o, norm+gate_up,
    silu+down, lm_head) with our other kernels (PDL default, and off). Answers what the non-GEMM
    kernels cost in situ and what the GEMVs save.
    """
    def weight(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, dtype=DT, device=device).mul_(in_f ** -0.5)

    f = torch.nn.functional
    w_qkv = [weight((HQ + 2 * HKV) * D, HIDDEN) for _ in range(layers)]
    w_o = [weight(HIDDEN, HQ * D) for _ in range(layers)]
    w_gu = [weight(2 * INTER, HIDDEN) for _ in range(layers)]
    w_down = [weight(HIDDEN, INTER) for _ in range(layers)]
    lm_head = weight(VOCAB if layers == 32 else 1024, HIDDEN)
    caches, tables = _paged_caches(1, ctx + 1, layers, device)
    seq_lens = torch.full((1,), ctx + 1, dtype=torch.int32, device=device)
    cos_sin = build_rope_cache(D, 8192, 500000.0, device=device)
    norm_w = torch.ones(HIDDEN, dtype=DT, device=device)
    x, res = torch.randn(1, HIDDEN, dtype=DT, device=device), torch.zeros(1, HIDDEN, dtype=DT, device=device)
    pos, slots = torch.tensor([ctx], device=device), torch.tensor([ctx], dtype=torch.int32, device=device)

    def attention(qkv: torch.Tensor, i: int) -> torch.Tensor:
        q = qkv[:, : HQ * D].view(1, HQ, D)
        k, v = qkv[:, HQ * D: (HQ + HKV) * D].view(1, HKV, D), qkv[:, (HQ + HKV) * D:].view(1, HKV, D)
        apply_rotary(q, k, pos, cos_sin, v=v, kv_cache=caches[i], slot_mapping=slots)
        return decode_attention(q, caches[i], tables, seq_lens, D ** -0.5).reshape(1, HQ * D)

    def step(kernels: bool):
        h = x.clone()
        for i in range(layers):
            if kernels:
                fused_add_rms_norm(h, res, norm_w, 1e-5, out=h)
            qkv = f.linear(h, w_qkv[i])                              # [1, 6144]
            h = f.linear(attention(qkv, i) if kernels else qkv[:, : HQ * D], w_o[i])
            if kernels:
                fused_add_rms_norm(h, res, norm_w, 1e-5, out=h)
            gu = f.linear(h, w_gu[i])
            h = f.linear(silu_and_mul(gu) if kernels else gu[:, :INTER], w_down[i])
        if kernels:
            h = rms_norm(h, norm_w, 1e-5)
        return f.linear(h, lm_head)

    def gemv_step(all_fused: bool):
        """As the model runs at batch 1 (only qkv takes a fused prologue: gemv.fuses_prologue)."""
        h, r = x.clone(), None
        for i in range(layers):
            qkv, r = add_rms_norm_gemv(h, r, norm_w, 1e-5, w_qkv[i])
            h = gemv(attention(qkv, i), w_o[i])
            if all_fused:
                gu, r = add_rms_norm_gemv(h, r, norm_w, 1e-5, w_gu[i])
                h = silu_mul_gemv(gu, w_down[i])
            else:
                h, r = fused_add_rms_norm(h, r, norm_w, 1e-5, out=h)
                h = gemv(silu_and_mul(gemv(h, w_gu[i])), w_down[i])
        h, _ = fused_add_rms_norm(h, r, norm_w, 1e-5)
        return gemv(h, lm_head)

    rows = []
    for name, fn, pdl in (("gemm_only", lambda: step(False), None), ("full", lambda: step(True), None),
                          ("full,pdl_off", lambda: step(True), False), ("gemv", lambda: gemv_step(False), None),
                          ("gemv,pdl_off", lambda: gemv_step(False), False),
                          ("gemv,all_fused", lambda: gemv_step(True), None)):
        set_pdl(pdl)
        try:
            sec = time_call(fn, device)
        finally:
            set_pdl(None)
        rows.append({"ctx": ctx, "variant": name, "ms_per_token": sec * 1e3, "tok_per_s": 1 / sec})
    return rows


def _gemv_cases(m: int, n: int, k: int, prologue: int, ws: list[torch.Tensor], device, sweep: list) -> dict:
    """variant name -> one call over every weight copy. cuBLAS F.linear, the unfused pair it
    replaces (our norm / SiLU kernel + cuBLAS), our plain GEMV per config, our fused GEMV."""
    f, nw = torch.nn.functional, torch.ones(k, dtype=DT, device=device)
    x, r = torch.randn(m, k, dtype=DT, device=device), torch.randn(m, k, dtype=DT, device=device)
    gu = torch.randn(m, 2 * k, dtype=DT, device=device)
    def tag(cfg: GemvConfig | None) -> str:
        return "" if cfg is None else str(tuple(cfg[:4])).replace(" ", "")

    cases = {"cublas": lambda: [f.linear(x, w) for w in ws]}
    for cfg in sweep:
        cases["gemv" + tag(cfg)] = lambda cfg=cfg: [gemv(x, w, config=cfg) for w in ws]
    if prologue == NORM:
        cases["cublas+add_norm"] = lambda: [f.linear(fused_add_rms_norm(x, r, nw, 1e-5)[0], w) for w in ws]
        for cfg in dict.fromkeys([None] + sweep):
            cases["add_norm_gemv" + tag(cfg)] = lambda cfg=cfg: [add_rms_norm_gemv(x, r, nw, 1e-5, w, config=cfg)
                                                                  for w in ws]
    elif prologue == SILU_MUL:
        cases["cublas+silu"] = lambda: [f.linear(silu_and_mul(gu), w) for w in ws]
        for cfg in dict.fromkeys([None] + sweep):
            cases["silu_gemv" + tag(cfg)] = lambda cfg=cfg: [silu_mul_gemv(gu, w, config=cfg) for w in ws]
    return cases


def bench_gemv(device, bw: float, smoke: bool = False) -> list[dict]:
    """Per shape and batch size: time per call and % of HBM read bandwidth (weight bytes only)."""
    rows = []
    for name, (n, k, prologue) in GEMV_SHAPES.items():
        n, k = (n // 64, k // 64) if smoke else (n, k)
        copies = max(2, min(16, _layers_for(n * k * 2, 256 * 2**20)))     # rotate well past the L2
        ws = [torch.randn(n, k, dtype=DT, device=device).mul_(k ** -0.5) for _ in range(copies)]
        for m in (1, 2, 4):
            sweep = GEMV_SWEEP[m][:2] if smoke else GEMV_SWEEP[m]
            for variant, fn in _gemv_cases(m, n, k, prologue, ws, device, sweep).items():
                try:
                    sec = time_call(fn, device) / copies
                except Exception as exc:  # noqa: BLE001
                    print(f"ERROR gemv {name} M={m} {variant}: {exc!r}", flush=True)
                    continue
                rows.append({"shape": name, "N": n, "K": k, "M": m, "variant": variant, "us": sec * 1e6,
                             "frac_of_read_bw": n * k * 2 / sec / bw})
        del ws
    return rows


def gemv_main(out_dir: str, smoke: bool = False) -> dict:
    """Only the GEMV table and the full decode step (`python -m tokenforge.bench.kernels OUT --gemv`)."""
    device = torch.device("cpu" if smoke else "cuda")
    torch.manual_seed(0)
    bw = hbm_read_bandwidth(device, gib=0.01 if smoke else 4.0)
    result: dict = {"device": torch.cuda.get_device_name() if not smoke else "cpu-interpreter",
                    "command": f"python -m tokenforge.bench.kernels {out_dir} --gemv", "git_commit": _git_commit(),
                    "torch": torch.__version__, "hbm_read_GBps": bw / 1e9}
    result["gemv"] = guarded(lambda: bench_gemv(device, 1.0 if smoke else bw, smoke), "gemv")
    _save(out_dir, result)
    result["decode_step_full"] = guarded(lambda: bench_full_decode_step(64 if smoke else 384, device,
                                                                          2 if smoke else 32), "full step")
    _save(out_dir, result)
    _print_table(result)
    return result


def main(out_dir: str, smoke: bool = False) -> dict:
    device = torch.device("cpu" if smoke else "cuda")
    torch.manual_seed(0)
    bw = hbm_read_bandwidth(device, gib=0.01 if smoke else 4.0)
    result: dict = {"device": torch.cuda.get_device_name() if not smoke else "cpu-interpreter",
                    "command": f"python -m tokenforge.bench.kernels {out_dir}", "git_commit": _git_commit(),
                    "torch": torch.__version__, "hbm_read_GBps": bw / 1e9, "decode": [], "prefill": [], "ops": []}
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
            _save(out_dir, result)
    cfgs = {"default": None, "q32_n64_w8_s3": (32, 64, 8, 3), "q16_n32_w4_s2": (16, 32, 4, 2)}
    prefill_cases = ([("1x64", [0], [64])] if smoke else
                     [("1x2048", [0], [2048]), ("8x512", [0] * 8, [512] * 8), ("chunk512_ctx3584", [3584], [512])])
    for name, ctx_l, q_l in prefill_cases:
        result["prefill"] += guarded(lambda: bench_prefill(name, ctx_l, q_l, cfgs, device), f"prefill {name}")
        _save(out_dir, result)
    for tokens in ([1, 3] if smoke else [1, 256, 2048]):
        result["ops"] += guarded(lambda: bench_ops(tokens, device, bw), f"ops T={tokens}")
    result["ops"] += guarded(lambda: bench_ops(1, device, bw, pdl=False), "ops T=1 pdl off")
    result["decode_step_full"] = guarded(lambda: bench_full_decode_step(64 if smoke else 384, device,
                                                                          2 if smoke else 32), "full step")
    _save(out_dir, result)
    result["decode_step_nongemm"] = guarded(lambda: bench_decode_step(64 if smoke else 384, device, 2 if smoke else 32),
                                            "decode step")
    _save(out_dir, result)
    _print_table(result)
    return result


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _save(out_dir: str, result: dict) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "kernels.json").write_text(json.dumps(result, indent=1))


def _print_table(r: dict) -> None:
    def ok(key: str) -> list[dict]:
        return [row for row in r.get(key, []) if "error" not in row]

    print(f"\n{r['device']}  HBM read {r['hbm_read_GBps']:.0f} GB/s")
    for row in ok("decode"):
        print(f"decode B={row['batch']:<4} ctx={row['ctx']:<5} {row['variant']:<14} {row['us']:8.2f} us "
              f"{row['GBps']:7.0f} GB/s  {100 * row['frac_of_read_bw']:5.1f}%")
    for row in ok("prefill"):
        print(f"prefill {row['case']:<17} {row['config']:<17} {row['us']:9.1f} us {row['TFLOPs']:6.1f} TFLOP/s")
    for row in ok("ops"):
        print(f"op {row['op']:<20} T={row['tokens']:<5} {row['us']:8.2f} us {row['GBps']:7.0f} GB/s "
              f"{100 * row['frac_of_read_bw']:5.1f}%")
    for row in ok("gemv"):
        print(f"gemv {row['shape']:<8} M={row['M']} {row['variant']:<32} {row['us']:8.2f} us "
              f"{100 * row['frac_of_read_bw']:5.1f}%")
    for row in ok("decode_step_nongemm"):
        print(f"B=1 decode step non-GEMM kernels, ctx {row['ctx']}, attention {row['variant']}: "
              f"{row['us_per_token']:.1f} us/token")
    for row in ok("decode_step_full"):
        print(f"B=1 decode step with GEMMs, ctx {row['ctx']}, {row['variant']:<13}: "
              f"{row['ms_per_token']:.3f} ms/token = {row['tok_per_s']:.1f} tok/s")

if __name__ == "__main__":
    (gemv_main if "--gemv" in sys.argv else main)(sys.argv[1] if len(sys.argv) > 1 else "bench/results",
                                                  smoke="--smoke" in sys.argv)
