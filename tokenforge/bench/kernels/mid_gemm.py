"""Kernel micro-benchmark: the 8B linears at serving batch sizes (M = 16-512) and a batch-1 verify's
rows (M = 5, 9, 17; M = 1 for reference) through cuBLAS, cuBLASLt and cuBLAS on padded rows, to find
what runs fastest per (shape, M).

In: an output folder. Out: `kernels_mid_gemm.json` there (saved after each shape) and one table
line per (shape, M). Run: `tokenforge bench kernels --part mid_gemm --out OUT` (under a minute on an
H100).

Why: serving_step.py found cuBLAS at 55-80% of the floor between M = 160 and 448 (gate_up at M = 448
45%, while M = 512 takes less time). Per (shape, M), each against the floor (the longer of reading
the weights at the measured read rate and the FLOPs at the measured matmul rate):
- cublas: F.linear as is; cublaslt: F.linear with preferred_blas_library("cublaslt");
- pad: cuBLAS at the smallest larger M of the list that beats cuBLAS at this M (padding the rows).
Everything graph-replayed over 4 copies of the weights, so they come from HBM. A Triton GEMM (12-17
tile configs, split-K, swapped operands) was a candidate in wave 3 round 11: it won only at M =
16-32, by 3-8%, and lost from M = 64 on (BENCHMARKS.md), so it was removed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from tokenforge.bench.kernels.common import DT, guarded, save_result, start_run, time_call
from tokenforge.bench.kernels.serving_step import SHAPES
from tokenforge.bench.lib.ceilings import gpu_matmul_tflops

# 1, 5, 9, 17: a decode row and the verify rows of one sequence with K = 4, 8, 16 drafts
MS = (1, 5, 9, 17, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 384, 448, 512)
COPIES = 4                      # 4 x 436 MB of a layer's weights: well past the L2
REPEATS = 10


def pad_choice(cublas_us: dict[int, float], m: int) -> int | None:
    """The smallest M' > m whose cuBLAS time beats cuBLAS at m (rows padded to M'), or None."""
    return next((m2 for m2 in sorted(cublas_us) if m2 > m and cublas_us[m2] < cublas_us[m]), None)


@contextlib.contextmanager
def blas_library(name: str):
    """F.linear through cuBLAS `name` ("cublas" / "cublaslt") inside, the previous choice after."""
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(prev)


def _timed(fn, device, copies: int) -> float:
    """Microseconds per layer of fn, which runs every copy once."""
    return time_call(fn, device, repeats=REPEATS) / copies * 1e6


def _entry(us: float | None, floor: float, **extra) -> dict:
    return {"us": us, "of_floor": floor / us if us else None, **extra}


def bench_shape(name: str, n: int, k: int, device, bw: float, flops: float, smoke: bool) -> list[dict]:
    """One row per M: cublas, cublaslt, pad, and the best of them."""
    ws = [torch.randn(n, k, dtype=DT, device=device) * 0.02 for _ in range(1 if smoke else COPIES)]
    rows = []
    for m in MS[:2] if smoke else MS:
        x = torch.randn(m, k, dtype=DT, device=device)
        floor = max(n * k * 2 / bw, 2 * m * n * k / flops) * 1e6
        def linear(x=x):
            for w in ws:
                F.linear(x, w)
        row = {"shape": name, "n": n, "k": k, "m": m, "floor_us": floor,
               "cublas": _entry(_timed(linear, device, len(ws)), floor)}
        if device.type == "cuda":
            with blas_library("cublaslt"):
                row["cublaslt"] = _entry(_timed(linear, device, len(ws)), floor)
        rows.append(row)
    _add_pad_and_best(rows)
    for row in rows:
        print(_line(row), flush=True)
    return rows


def _add_pad_and_best(rows: list[dict]) -> None:
    cublas_us = {r["m"]: r["cublas"]["us"] for r in rows}
    for row in rows:
        m2 = pad_choice(cublas_us, row["m"])
        row["pad"] = _entry(cublas_us[m2], row["floor_us"], m=m2) if m2 else None
        options = {key: row[key]["us"] for key in ("cublas", "cublaslt", "pad")
                   if row.get(key) and row[key].get("us")}
        row["best"] = min(options, key=options.get)


def _line(row: dict) -> str:
    def cell(key: str) -> str:
        e = row.get(key)
        return f"{key} {e['us']:7.1f} {100 * e['of_floor']:3.0f}%" if e and e.get("us") else f"{key} {'-':>12}"
    pad = f" (M'={row['pad']['m']})" if row["pad"] else ""
    return (f"{row['shape']:8s} M={row['m']:4d} floor {row['floor_us']:7.1f} | {cell('cublas')} | {cell('cublaslt')} "
            f"| {cell('pad')}{pad} | best {row['best']}")


def run(out_dir: str, smoke: bool = False) -> dict:
    device, bw, result = start_run(out_dir, smoke, " --part mid_gemm")
    bw = 1e12 if smoke else bw
    flops = 1e12 if smoke else gpu_matmul_tflops() * 1e12
    result |= {"matmul_tflops": flops / 1e12, "copies": 1 if smoke else COPIES, "rows": []}
    shapes = (("wide", 96, 128), ("narrow", 64, 256)) if smoke else SHAPES
    for name, n, k in shapes:
        result["rows"] += guarded(lambda name=name, n=n, k=k: bench_shape(name, n, k, device, bw, flops, smoke),
                                  f"mid_gemm {name}")
        save_result(out_dir, result, "kernels_mid_gemm.json")
    return result
