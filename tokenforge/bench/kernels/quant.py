"""Kernel micro-benchmark of the quantized linears, per Llama-3.1-8B GEMV shape.

    tokenforge bench kernels --part quant --out OUT_DIR [--smoke]

Out: OUT_DIR/kernels_quant.json and a table: for each shape (qkv, o, gate_up, down, lm_head)
at M = 1, the bf16 GEMV against the int8 and int4 dequant-fused GEMVs (every tile config of a
small sweep, and the fused norm / SiLU prologues), in microseconds and GB/s of weight bytes read;
at M = 2, 4 the GEMVs against cuBLAS; at larger M the dequantize + cuBLAS path and fp8
`_scaled_mm` (with its per-token activation quantization) against bf16 cuBLAS. Same method as
attention.py: CUDA-graph replays, weight copies rotated past the L2, read ceiling in the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tokenforge.bench.kernels.common import DT, HIDDEN, HKV, HQ, INTER, VOCAB, D, guarded, layers_for, start_run, \
    time_call
from tokenforge.kernels.gemv import NORM, PLAIN, SILU_MUL, gemv
from tokenforge.kernels.quant_gemv import QUANT_CHANNEL, QUANT_INT4, QGemvConfig, qgemv, qgemv_config
from tokenforge.kernels.quant_ops import dequantize_channel, dequantize_int4, per_token_quant_fp8
from tokenforge.model.quant.fp8 import quantize_fp8_channel
from tokenforge.model.quant.int4 import quantize_int4_groups
from tokenforge.model.quant.int8 import quantize_int8_channel

SHAPES = {"qkv": ((HQ + 2 * HKV) * D, HIDDEN, NORM), "o": (HIDDEN, HQ * D, PLAIN),
          "gate_up": (2 * INTER, HIDDEN, NORM), "down": (HIDDEN, INTER, SILU_MUL), "lm_head": (VOCAB, HIDDEN, PLAIN)}
SWEEP = {QUANT_CHANNEL: [(2, 1024), (4, 1024), (8, 512), (2, 2048), (8, 1024, 8)],
         QUANT_INT4: [(4, 512), (8, 256), (8, 1024), (8, 1024, 8), (2, 1024), (8, 512, 4, True, True),
                      (16, 512, 4, True, True)]}   # the last two: round 2's split nibbles
GROUP = 128


def _bytes(kind: str, n: int, k: int) -> int:
    return {"bf16": n * k * 2, "int8": n * k + 4 * n, "fp8": n * k + 4 * n,
            "int4": n * k // 2 + n * (k // GROUP) * 4}[kind]


def _copies(kind: str, n: int, k: int, device) -> list[tuple]:
    """Enough weight copies to rotate past the L2 (kernels.layers_for), quantized as `kind`."""
    copies = []
    w = torch.randn(n, k, dtype=DT, device=device).mul_(k ** -0.5)
    for _ in range(layers_for(_bytes(kind, n, k), cap=16)):
        if kind == "bf16":
            copies.append((w.clone(),))
        elif kind == "int8":
            copies.append(quantize_int8_channel(w))
        elif kind == "fp8":
            copies.append(quantize_fp8_channel(w))
        else:
            copies.append(quantize_int4_groups(w, GROUP, DT))
    return copies


def _row(shape: str, m: int, kind: str, variant: str, sec: float, nbytes: int, bw: float) -> dict:
    return {"shape": shape, "M": m, "kind": kind, "variant": variant, "us": sec * 1e6,
            "GBps": nbytes / sec / 1e9, "frac_of_read_bw": nbytes / sec / bw}


def bench_m1(name: str, device, bw: float) -> list[dict]:
    n, k, prologue = SHAPES[name]
    x = torch.randn(1, k, dtype=DT, device=device)
    gu = torch.randn(1, 2 * k, dtype=DT, device=device)
    r, nw = torch.randn(1, k, dtype=DT, device=device), torch.ones(k, dtype=DT, device=device)
    rows = []
    ws = _copies("bf16", n, k, device)
    rows.append(_row(name, 1, "bf16", "gemv", time_call(lambda: [gemv(x, w) for (w,) in ws], device) / len(ws),
                     _bytes("bf16", n, k), bw))
    del ws
    for kind, quant in (("int8", QUANT_CHANNEL), ("int4", QUANT_INT4)):
        qs = _copies(kind, n, k, device)
        default = qgemv_config(quant, n, k, GROUP)
        for tiles in [tuple(default)] + [c for c in SWEEP[quant] if QGemvConfig(*c) != default]:
            cfg = QGemvConfig(*tiles)
            fn = lambda cfg=cfg: [qgemv(PLAIN, quant, x, *q, group=GROUP, config=cfg) for q in qs]  # noqa: E731
            tag = (f"qgemv({cfg.block_n},{cfg.block_k},w{cfg.num_warps}{',split' if cfg.int4_split else ''})"
                   + ("*" if cfg == default else ""))
            rows.append(_row(name, 1, kind, tag, time_call(fn, device) / len(qs), _bytes(kind, n, k), bw))
        cfg = QGemvConfig(*default[:3], magic=False)          # the converter unit instead of exponent bits
        fn = lambda cfg=cfg: [qgemv(PLAIN, quant, x, *q, group=GROUP, config=cfg) for q in qs]  # noqa: E731
        rows.append(_row(name, 1, kind, "qgemv*,cvt", time_call(fn, device) / len(qs), _bytes(kind, n, k), bw))
        if prologue == NORM:
            fn = lambda: [qgemv(NORM, quant, x, *q, residual=r, norm_weight=nw, eps=1e-5, group=GROUP) for q in qs]  # noqa: E731
            rows.append(_row(name, 1, kind, "qgemv+norm", time_call(fn, device) / len(qs), _bytes(kind, n, k), bw))
        elif prologue == SILU_MUL:
            fn = lambda: [qgemv(SILU_MUL, quant, gu, *q, group=GROUP) for q in qs]  # noqa: E731
            rows.append(_row(name, 1, kind, "qgemv+silu", time_call(fn, device) / len(qs), _bytes(kind, n, k), bw))
        if kind == "int8":     # fp8-stored weights take the same per-channel kernel
            fq = _copies("fp8", n, k, device)
            fn = lambda: [qgemv(PLAIN, QUANT_CHANNEL, x, *q) for q in fq]  # noqa: E731
            rows.append(_row(name, 1, "fp8", "qgemv(w-only)", time_call(fn, device) / len(fq), _bytes("fp8", n, k), bw))
            del fq
        del qs
    return rows


def bench_many_rows(name: str, device, bw: float, ms=(2, 4, 256)) -> list[dict]:
    """Rows > 1: cuBLAS bf16 vs the quantized paths (GEMV up to 4 rows, dequant + cuBLAS, fp8 _scaled_mm)."""
    n, k, _ = SHAPES[name]
    f = torch.nn.functional
    w = torch.randn(n, k, dtype=DT, device=device).mul_(k ** -0.5)
    q8, s8 = quantize_int8_channel(w)
    p4, sc4, z4 = quantize_int4_groups(w, GROUP, DT)
    f8, fs = quantize_fp8_channel(w)
    fs_row = fs.view(1, -1)
    rows = []
    for m in ms:
        x = torch.randn(m, k, dtype=DT, device=device)
        cases = {("bf16", "cublas"): lambda: f.linear(x, w),
                 ("int8", "dequant+cublas"): lambda: f.linear(x, dequantize_channel(q8, s8, DT)),
                 ("int4", "dequant+cublas"): lambda: f.linear(x, dequantize_int4(p4, sc4, z4, DT, GROUP))}
        if m <= 4:
            cases[("int8", "qgemv")] = lambda: qgemv(PLAIN, QUANT_CHANNEL, x, q8, s8)
            cases[("int4", "qgemv")] = lambda: qgemv(PLAIN, QUANT_INT4, x, p4, sc4, z4, group=GROUP)
        else:
            def fp8_mm(fast: bool = True):
                xq, xs = per_token_quant_fp8(x)
                return torch._scaled_mm(xq, f8.t(), scale_a=xs, scale_b=fs_row, out_dtype=DT, use_fast_accum=fast)
            cases[("fp8", "quant+scaled_mm")] = fp8_mm
            cases[("fp8", "quant+scaled_mm,exact")] = lambda: fp8_mm(False)
        for (kind, variant), fn in cases.items():
            sec = time_call(fn, device)
            row = _row(name, m, kind, variant, sec, _bytes(kind, n, k), bw)
            row["TFLOPs"] = 2 * m * n * k / sec / 1e12
            rows.append(row)
    return rows


def run(out_dir: str, smoke: bool = False) -> dict:
    device, bw, result = start_run(out_dir, smoke, " --part quant")
    names = ["o"] if smoke else list(SHAPES)
    result["gemv_m1"] = [r for name in names for r in guarded(lambda name=name: bench_m1(name, device, bw), f"m1 {name}")]
    result["many_rows"] = [r for name in (["o"] if smoke else ["gate_up"])
                           for r in guarded(lambda name=name: bench_many_rows(name, device, bw), f"rows {name}")]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "kernels_quant.json").write_text(json.dumps(result, indent=1))
    print_table(result)
    return result


def print_table(r: dict) -> None:
    print(f"\n{r['device']}  HBM read {r['hbm_read_GBps']:.0f} GB/s   (* = the default config)")
    for row in r["gemv_m1"]:
        if "error" not in row:
            print(f"M=1 {row['shape']:<8} {row['kind']:<5} {row['variant']:<18} {row['us']:8.2f} us "
                  f"{row['GBps']:7.0f} GB/s {100 * row['frac_of_read_bw']:5.1f}%")
    for row in r["many_rows"]:
        if "error" not in row:
            print(f"M={row['M']:<5} {row['shape']:<8} {row['kind']:<5} {row['variant']:<18} {row['us']:9.2f} us "
                  f"{row['TFLOPs']:7.1f} TFLOP/s")

