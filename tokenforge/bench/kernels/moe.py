"""Kernel micro-benchmark, the fused MoE: decode batches 1-16 on real expert shapes.

In: an output folder (`tokenforge bench kernels --part moe --out OUT`). Out: per shape and batch,
the time of the engine's MoE step from the router's logits (`fused_moe_from_logits`: routing and
alignment in one launch, gate-up + SwiGLU, down + routing weights, the sum over k; `fused_moe`
after torch routing where the batch is too large for that launch) replayed as a CUDA graph, the
bytes of the experts the batch selects, and their fraction of the read rate measured in the same run, in `kernels_moe.json`; the gpt-oss shapes also as shipped,
with MXFP4 experts (`<shape>-mxfp4`, 17 bytes per 32 values), and Mixtral's and Qwen3-MoE's with
fp8 experts as `--quantization fp8` stores them (`<shape>-fp8`: e4m3 and a scale per row, a byte a
value; the scales' bytes are not counted). Several weight sets are replayed in
turn so that no set stays in the L2; the error against `moe_reference` is recorded with each row.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tokenforge.bench.kernels.common import start_run
from tokenforge.kernels.moe import fused_moe, moe_reference, route
from tokenforge.kernels.moe_fp8 import Fp8Stack, quantize_fp8_stack
from tokenforge.kernels.moe_routing import fused_moe_from_logits
from tokenforge.kernels.mxfp4 import Mxfp4Stack

# name -> (hidden, intermediate per expert, experts, top-k): the real configs' expert MLPs
SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8),
          "gpt-oss-20b": (2880, 2880, 32, 4), "gpt-oss-120b": (2880, 2880, 128, 4)}
BATCHES = (1, 2, 4, 8, 16)


def _graph_time(calls: list, repeats: int = 50) -> float:
    """Median seconds of one call, each call captured in its own graph and replayed in turn
    (on the CPU, `--smoke`: one plain call, to check the script)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        calls[0]()
        return time.perf_counter() - start
    graphs = []
    for fn in calls:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs[i % len(graphs)].replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _float_experts(e: int, h: int, i: int, device) -> tuple:
    return (torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16) * h ** -0.5,
            torch.randn(e, h, i, device=device, dtype=torch.bfloat16) * i ** -0.5)


def _mxfp4_experts(e: int, h: int, i: int, device) -> tuple:
    """Random codes, scales near 2^-7 (the dummy loader's), as gpt-oss's checkpoints store them."""
    def stack(rows: int, cols: int) -> Mxfp4Stack:
        return Mxfp4Stack(torch.randint(0, 256, (e, rows, cols // 32, 16), device=device, dtype=torch.uint8),
                          torch.randint(119, 122, (e, rows, cols // 32), device=device, dtype=torch.uint8))
    return stack(2 * i, h), stack(h, i)


def _fp8_experts(e: int, h: int, i: int, device) -> tuple:
    """The float experts quantized as `--quantization fp8` does (model/quant/experts.py)."""
    return tuple(Fp8Stack(*quantize_fp8_stack(w)) for w in _float_experts(e, h, i, device))


def engine_step(x, logits, w13, w2, k: int, **kwargs):
    """What a MoE layer runs on the fused path (layers/moe.py): the one-launch routing when the
    batch fits it, else torch routing and `fused_moe`."""
    out = fused_moe_from_logits(x, logits, w13, w2, k, "softmax_topk", True, **kwargs)
    if out is None:
        weights, ids = route(logits, k)
        out = fused_moe(x, w13, w2, weights, ids, **kwargs)
    return out


def _measure(name: str, h: int, i: int, e: int, k: int, make, value_bytes: float, smoke: bool, device,
             bw: float) -> list[dict]:
    """One shape's rows: each decode batch replayed over several weight sets (more than the L2)."""
    sets = 2 if smoke else min(6, max(2, int(8e9 // (e * 3 * h * i * value_bytes))))
    experts = [make(e, h, i, device) for _ in range(sets)]
    rows = []
    for t in BATCHES:
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        logits = torch.randn(t, e, device=device)
        weights, ids = route(logits, k)
        ref = moe_reference(x, *experts[0], weights, ids).float()
        err = ((engine_step(x, logits, *experts[0], k, all_local=True).float() - ref).norm() / ref.norm()).item()
        seconds = _graph_time([lambda s=s: engine_step(x, logits, *experts[s], k, all_local=True)
                               for s in range(sets)])
        used = ids.unique().numel()
        nbytes = used * 3 * h * i * value_bytes
        rows.append({"shape": name, "tokens": t, "experts_read": used, "us": seconds * 1e6,
                     "GBps": nbytes / seconds / 1e9, "frac_of_read": nbytes / seconds / bw, "rel_err": err})
        print(f"{name:20s} T={t:<3d} {seconds * 1e6:8.1f} us  experts {used:3d}  "
              f"{nbytes / seconds / 1e9:6.0f} GB/s  {nbytes / seconds / bw:6.1%} of read  err {err:.1e}")
    return rows


def run(out_dir: str, smoke: bool = False) -> dict:
    device, bw, result = start_run(out_dir, smoke, " --part moe")
    rows = []
    for name, (h, i, e, k) in SHAPES.items():
        if smoke:
            h, i, e = 64, 64, min(e, 8)
        rows += _measure(name, h, i, e, k, _float_experts, 2, smoke, device, bw)
        if name.startswith("gpt-oss"):      # as shipped: MXFP4 experts, 17 bytes per 32 values
            rows += _measure(f"{name}-mxfp4", h, i, e, k, _mxfp4_experts, 17 / 32, smoke, device, bw)
        else:                               # bf16 checkpoints under --quantization fp8
            rows += _measure(f"{name}-fp8", h, i, e, k, _fp8_experts, 1, smoke, device, bw)
        torch.cuda.empty_cache()            # free this shape before the next
    result["moe"] = rows
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "kernels_moe.json").write_text(json.dumps(result, indent=1))
    return result
