"""What the kernel micro-benchmarks share: Llama-3.1-8B shapes, CUDA-graph timing, the HBM read
ceiling measured in the run, guarded sections, and the kernels.json record and table.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

HQ, HKV, D, BS, HIDDEN, INTER, VOCAB = 32, 8, 128, 16, 4096, 14336, 128256
DT = torch.bfloat16


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


def layers_for(bytes_per_layer: int, target: int = 512 * 2**20, cap: int = 128) -> int:
    return max(2, min(cap, math.ceil(target / max(bytes_per_layer, 1))))


def paged_caches(batch: int, seq_len: int, layers: int, device: torch.device):
    """`layers` random KV caches plus one shuffled block table [batch, blocks] shared by them."""
    per_seq = -(-seq_len // BS)
    num_blocks = batch * per_seq
    caches = [torch.randn(2, num_blocks, BS, HKV, D, dtype=DT, device=device) for _ in range(layers)]
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, per_seq)
    return caches, tables


def start_run(out_dir: str, smoke: bool, flags: str = "") -> tuple[torch.device, float, dict]:
    """(device, measured HBM read bytes/s, the result record) for a kernel bench run."""
    device = torch.device("cpu" if smoke else "cuda")
    torch.manual_seed(0)
    bw = hbm_read_bandwidth(device, gib=0.01 if smoke else 4.0)
    result: dict = {"device": torch.cuda.get_device_name() if not smoke else "cpu-interpreter",
                    "command": f"tokenforge bench kernels --out {out_dir}{flags}", "git_commit": _git_commit(),
                    "torch": torch.__version__, "hbm_read_GBps": bw / 1e9}
    return device, bw, result


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def save_result(out_dir: str, result: dict, name: str = "kernels.json") -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / name).write_text(json.dumps(result, indent=1))


def print_table(r: dict) -> None:
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
