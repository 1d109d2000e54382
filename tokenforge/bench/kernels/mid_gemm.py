"""Kernel micro-benchmark: the 8B linears at serving batch sizes (M = 16-512), cuBLAS against the
Triton GEMM's tile candidates, to find what runs fastest per (shape, M).

In: an output folder. Out: `kernels_mid_gemm.json` there (saved after each shape) and one table
line per (shape, M). Run: `tokenforge bench kernels --part mid_gemm --out OUT` (about 1-2 minutes
on an H100, Triton compiles included).

Why: serving_step.py found cuBLAS at 55-80% of the floor between M = 160 and 448 (gate_up at M = 448
45%, while M = 512 takes less time). Per (shape, M), each against the floor (the longer of reading
the weights at the measured read rate and the FLOPs at the measured matmul rate):
- cublas: F.linear as is; cublaslt: F.linear with preferred_blas_library("cublaslt");
- triton: kernels/gemm.py over a compact candidate list (the best config and every time); each
  config compiles once (M is a runtime argument); tiles that waste most of their rows, need more
  than 8 row tiles, or split K where the tiles already fill the SMs are skipped;
- pad: cuBLAS at the smallest larger M of the list that beats cuBLAS at this M (padding the rows).
Everything graph-replayed over 4 copies of the weights, so they come from HBM.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from tokenforge import envs
from tokenforge.bench.kernels.common import DT, guarded, save_result, start_run, time_call
from tokenforge.bench.kernels.serving_step import SHAPES
from tokenforge.bench.lib.ceilings import gpu_matmul_tflops
from tokenforge.kernels._triton import HAS_TRITON, cdiv
from tokenforge.kernels.gemm import GemmConfig, check_config, gemm, row_use

MS = (16, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 384, 448, 512)
COPIES = 4                      # 4 x 436 MB of a layer's weights: well past the L2
REPEATS = 10
MAX_ROW_TILES = 8               # more row tiles re-read each weight tile from L2 too often


def _cfg(bm: int, bn: int, bk: int, stages: int, warps: int = 4, split: int = 1, swap: bool = False) -> GemmConfig:
    return GemmConfig(bm, bn, bk, group_m=8, split_k=split, num_warps=warps, num_stages=stages, swap_ab=swap)


# Swapped tiles (the weight rows on wgmma's M side) for small batches; plain tiles with 64 or 128
# rows (wgmma) and one with 32 (mma.sync, for comparison).
_SWAPPED = [_cfg(16, 128, 128, 4, swap=True), _cfg(32, 128, 128, 4, swap=True), _cfg(64, 128, 128, 3, swap=True),
            _cfg(32, 64, 128, 5, swap=True)]
_PLAIN = [_cfg(32, 128, 64, 4), _cfg(64, 128, 64, 4), _cfg(64, 128, 128, 3), _cfg(64, 256, 64, 4, warps=8),
          _cfg(128, 64, 64, 5), _cfg(128, 128, 64, 4, warps=8), _cfg(128, 128, 128, 3, warps=8),
          _cfg(128, 256, 64, 3, warps=8)]
# Split-K for N = 4096, where few output tiles leave SMs idle.
_SPLIT = [_cfg(16, 128, 128, 4, split=4, swap=True), _cfg(32, 128, 128, 4, split=4, swap=True),
          _cfg(32, 64, 128, 4, split=2, swap=True), _cfg(64, 128, 64, 4, split=2),
          _cfg(128, 128, 64, 4, warps=8, split=2)]


def candidates(n: int) -> list[GemmConfig]:
    """The configs tried for an N-wide linear (12-17)."""
    return _SWAPPED + _PLAIN + (_SPLIT if n <= 4096 else [])


def fits(cfg: GemmConfig, m: int, n: int, k: int, sms: int) -> bool:
    """Whether cfg is worth timing at M = m: few padded rows, few row tiles, split-K only where the
    output tiles leave SMs idle."""
    if check_config(cfg, k) is not None or row_use(cfg, m) < 0.5 or cdiv(m, cfg.block_m) > MAX_ROW_TILES:
        return False
    return cfg.split_k == 1 or cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n) < sms


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


def _triton_times(x, ws, m, n, k, sms, device, smoke) -> list[dict]:
    """Each fitting candidate's us (or its error) at M = m."""
    fitting = [c for c in candidates(n) if fits(c, m, n, k, sms)]
    out = []
    for cfg in fitting[::4] if smoke else fitting:
        try:
            us = _timed(lambda cfg=cfg: [gemm(x, w, cfg) for w in ws], device, len(ws))
            out.append({"config": cfg.label(), "us": us})
        except Exception as exc:  # noqa: BLE001 - a config that cannot compile or launch is a row, not the end
            out.append({"config": cfg.label(), "error": repr(exc)[:200]})
    return out


def bench_shape(name: str, n: int, k: int, device, bw: float, flops: float, smoke: bool) -> list[dict]:
    """One row per M: cublas, cublaslt, the best Triton config, pad, and the best of them."""
    ws = [torch.randn(n, k, dtype=DT, device=device) * 0.02 for _ in range(1 if smoke else COPIES)]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    can_triton = HAS_TRITON and (device.type == "cuda" or envs.triton_interpret())
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
        tried = _triton_times(x, ws, m, n, k, sms, device, smoke) if can_triton else []
        timed = [t for t in tried if "us" in t]
        best = min(timed, key=lambda t: t["us"]) if timed else None
        row["triton"] = _entry(best["us"], floor, config=best["config"]) if best else \
            {"skipped": "no config ran" if can_triton else "Triton cannot run here"}
        row["triton_configs"] = tried
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
        options = {key: row[key]["us"] for key in ("cublas", "cublaslt", "triton", "pad")
                   if row.get(key) and row[key].get("us")}
        row["best"] = min(options, key=options.get)


def _line(row: dict) -> str:
    def cell(key: str) -> str:
        e = row.get(key)
        return f"{key} {e['us']:7.1f} {100 * e['of_floor']:3.0f}%" if e and e.get("us") else f"{key} {'-':>12}"
    pad = f" (M'={row['pad']['m']})" if row["pad"] else ""
    config = row["triton"].get("config", "")
    return (f"{row['shape']:8s} M={row['m']:4d} floor {row['floor_us']:7.1f} | {cell('cublas')} | {cell('cublaslt')} "
            f"| {cell('triton')} [{config}] | {cell('pad')}{pad} | best {row['best']}")


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
