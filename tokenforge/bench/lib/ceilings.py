"""Hardware ceilings measured in the same run as every benchmark.

Out: {"read_bw_tbps", "matmul_tflops"} for the device, so each figure can be put against the limit
it can reach. GPU: a bf16 `sum` over 4 GiB (read bandwidth) and an 8192^3 bf16 matmul, timed with
CUDA events, median of 10 after 3 warm-ups. CPU: a short GEMM and a memory read, wall-clock timed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

GIB = 2**30


def _cuda_median_ms(fn, warmup: int = 3, repeats: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _wall_median_s(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_read_bandwidth_tbps(size_bytes: int = 4 * GIB) -> float:
    x = torch.ones(size_bytes // 2, dtype=torch.bfloat16, device="cuda")  # [n]
    ms = _cuda_median_ms(lambda: x.sum(dtype=torch.float32))
    return size_bytes / (ms * 1e-3) / 1e12    # x is freed on return; the caller empties the cache


def gpu_matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")  # [n, n]
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")  # [n, n]
    ms = _cuda_median_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def cpu_read_bandwidth_tbps(size_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    # Far larger than the caches, so the sum streams from DRAM.
    x = torch.ones(size_bytes // 4, dtype=torch.float32)  # [n]
    s = _wall_median_s(lambda: x.sum(), warmup=1, repeats=repeats)
    return size_bytes / s / 1e12


def cpu_matmul_tflops(n: int = 1024, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    a = torch.randn(n, n).to(dtype)  # [n, n]
    b = torch.randn(n, n).to(dtype)  # [n, n]
    s = _wall_median_s(lambda: a @ b, warmup=1, repeats=repeats)
    return 2 * n**3 / s / 1e12


def measure_ceilings(device: str, quick: bool = False) -> dict:
    """The ceilings for `device` ("cuda" or "cpu"); `quick` shrinks the CPU probes for smoke runs."""
    if device == "cuda":
        out = {"read_bw_tbps": gpu_read_bandwidth_tbps(), "matmul_tflops": gpu_matmul_tflops()}
        torch.cuda.empty_cache()    # leave the whole GPU to the engine and the HF peer
        return out
    size, n, reps = (32 * 2**20, 256, 2) if quick else (256 * 2**20, 1024, 5)
    out = {
        "read_bw_tbps": cpu_read_bandwidth_tbps(size, reps),
        "matmul_tflops": cpu_matmul_tflops(n, torch.float32, reps),
    }
    if not quick:
        out["matmul_tflops_bf16"] = cpu_matmul_tflops(n, torch.bfloat16, reps)
    return out


def describe(ceilings: dict) -> str:
    bw, mm = ceilings["read_bw_tbps"], ceilings["matmul_tflops"]
    if bw < 0.5:   # CPU-scale numbers read better in GB/s and GFLOP/s
        return f"read {bw * 1e3:.1f} GB/s, matmul {mm * 1e3:.1f} GFLOP/s"
    return f"read {bw:.2f} TB/s, matmul {mm:.0f} TFLOP/s"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="also copy the results JSON to this folder")
    p.add_argument("--results-dir", default=None, help="results folder (default: the current directory)")
    p.add_argument("--quick-ceilings", action="store_true", help="tiny CPU probes (smoke runs only)")


def main(args: argparse.Namespace) -> dict:
    """`tokenforge bench ceilings`: just the hardware limits."""
    from tokenforge.bench.lib import report  # noqa: PLC0415 - keep the module import light

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ceilings = measure_ceilings(device, quick=getattr(args, "quick_ceilings", False))
    result = report.new_result("ceilings", model=None, dtype="bfloat16" if device == "cuda" else "float32")
    result["ceilings"] = ceilings
    report.print_table("ceilings", ["metric", "value"], [[k, f"{v:.4g}"] for k, v in ceilings.items()])
    report.save(result, args)
    return result
