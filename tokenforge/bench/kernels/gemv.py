"""Kernel micro-benchmark, part 2: the small-M GEMVs and a whole batch-1 decode step.

In: an output folder (`tokenforge bench kernels --part gemv --out OUT`; attention.run also runs
the decode step). Out: the per-shape GEMV table against cuBLAS and
the batch-1 Llama-3.1-8B decode step with cuBLAS or with our GEMVs, in `kernels.json`. Same
method as attention.py: CUDA-graph replays, weights rotated past the L2, read ceiling in the run.
"""

from __future__ import annotations

import torch

from tokenforge.bench.kernels.common import (
    DT, HIDDEN, HKV, HQ, INTER, VOCAB, D, layers_for, paged_caches, print_table, save_result, guarded, start_run,
    time_call,
)
from tokenforge.kernels._triton import set_pdl
from tokenforge.kernels.activation import silu_and_mul
from tokenforge.kernels.gemv import NORM, PLAIN, SILU_MUL, GemvConfig, add_rms_norm_gemv, gemv, silu_mul_gemv
from tokenforge.kernels.paged_attention import decode_attention
from tokenforge.kernels.rms_norm import fused_add_rms_norm, rms_norm
from tokenforge.kernels.rotary import apply_rotary, build_rope_cache

# name -> (N, K, the prologue the model fuses into it)
GEMV_SHAPES = {"qkv": ((HQ + 2 * HKV) * D, HIDDEN, NORM), "o": (HIDDEN, HQ * D, PLAIN),
               "gate_up": (2 * INTER, HIDDEN, NORM), "down": (HIDDEN, INTER, SILU_MUL),
               "lm_head": (VOCAB, HIDDEN, PLAIN)}
GEMV_SWEEP = {1: [GemvConfig(1, bn, bk) for bn, bk in ((2, 1024), (4, 512), (4, 1024), (8, 512), (8, 1024))],
              2: [GemvConfig(2, bn, bk) for bn, bk in ((2, 1024), (4, 512), (8, 256))],
              4: [GemvConfig(4, bn, bk) for bn, bk in ((2, 512), (4, 256), (8, 128))]}


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
    caches, tables = paged_caches(1, ctx + 1, layers, device)
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
        copies = max(2, min(16, layers_for(n * k * 2, 256 * 2**20)))     # rotate well past the L2
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


def run(out_dir: str, smoke: bool = False) -> dict:
    """Only the GEMV table and the full decode step (`tokenforge bench kernels --part gemv --out OUT`)."""
    device, bw, result = start_run(out_dir, smoke, " --gemv")
    result["gemv"] = guarded(lambda: bench_gemv(device, 1.0 if smoke else bw, smoke), "gemv")
    save_result(out_dir, result)
    result["decode_step_full"] = guarded(lambda: bench_full_decode_step(64 if smoke else 384, device,
                                                                          2 if smoke else 32), "full step")
    save_result(out_dir, result)
    print_table(result)
    return result
