"""The decode-kernel sweep of the quantized linears, and the kernel table it measures.

    tokenforge bench kernels --part quant_sweep --out OUT_DIR [--smoke]

For the Llama-3.1-8B and 70B linear shapes x M in (1, 4, 8, 16): every split-K config of
kernels/quant_splitk.py (int4, int8 per channel, fp8 W8A8), the prologue GEMV of quant_gemv.py
(M <= 4), torch's tinygemm int4, the many-row paths (dequantize + cuBLAS; fp8 per-token quant +
_scaled_mm) and bf16 cuBLAS, each timed as CUDA-graph replays over weight copies rotated past
the L2, in us, GB/s of weight bytes and the fraction of the HBM read rate measured in the run.
Each split-K config's output is checked against the dequantized product once per shape (`err`).
Out: OUT_DIR/kernels_qsweep.json (the rows) and OUT_DIR/quant_table.json: per (kind, shape) the
fastest backend per M bucket (int4: one layout tile per shape, the one with the least total
time), in model/quant/kernel_table.json's format, ready to be copied there.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenforge.bench.kernels.common import DT, guarded, layers_for, start_run, time_call
from tokenforge.kernels import int4_tinygemm
from tokenforge.kernels.gemv import PLAIN
from tokenforge.kernels.quant_gemv import QUANT_CHANNEL as QG_CHANNEL, QUANT_INT4 as QG_INT4, qgemv
from tokenforge.kernels.quant_ops import dequantize_channel, dequantize_int4, per_token_quant_fp8
from tokenforge.kernels.quant_splitk import (QUANT_CHANNEL, QUANT_FP8_A8, QUANT_INT4, SplitKConfig, check_config,
                                             new_counters, quantize_act_blocks_ref, repack_groups, repack_int4,
                                             splitk_gemm)

SHAPES = {"8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
          "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}}
MS = (1, 4, 8, 16)
GROUP = 128
SMS = 132
# (block_n, block_k, dot, num_warps, stages[, asm]); split-K is chosen per shape for ~4 waves of programs
CONFIGS = {"int4": [(64, 256, True, 4, 1), (128, 256, True, 8, 1), (64, 512, True, 4, 1), (128, 512, True, 4, 3),
                    (64, 512, True, 4, 1, False), (32, 256, False, 4, 1)],
           "int8": [(64, 256, True, 4, 1), (128, 256, True, 8, 3), (32, 256, False, 4, 1)],
           "fp8": [(64, 256, True, 4, 1), (128, 256, True, 8, 3)]}
SMOKE_CONFIGS = {"int4": [(16, 128, True, 4, 1), (16, 128, False, 4, 1)], "int8": [(16, 128, True, 4, 1)],
                 "fp8": [(16, 128, True, 4, 1)]}


def split_for(n: int, k: int, block_n: int, block_k: int, waves: int = 4) -> int:
    tiles_n, split = -(-n // block_n), 1
    while tiles_n * split < waves * SMS and split * 2 <= k // block_k and split < 16:
        split *= 2
    return split


def weight_bytes(kind: str, n: int, k: int) -> int:
    return {"bf16": 2 * n * k, "int4": n * k // 2 + 4 * n * (k // GROUP)}.get(kind, n * k + 4 * n)


def _row(model: str, shape: str, m: int, kind: str, backend: str, label: str, sec: float, nbytes: int,
         bw: float, cfg: tuple | None = None, **extra) -> dict:
    return {"model": model, "shape": shape, "M": m, "kind": kind, "backend": backend, "variant": label,
            "us": sec * 1e6, "GBps": nbytes / sec / 1e9, "frac_of_read_bw": nbytes / sec / bw,
            "config": list(cfg) if cfg else None, **extra}


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _copies(kind: str, w: torch.Tensor, count: int) -> list[tuple]:
    from tokenforge.model.quant.fp8 import quantize_fp8_channel  # noqa: PLC0415
    from tokenforge.model.quant.int4 import quantize_int4_groups  # noqa: PLC0415
    from tokenforge.model.quant.int8 import quantize_int8_channel  # noqa: PLC0415

    quantize = {"int4": lambda t: quantize_int4_groups(t, GROUP, DT), "int8": quantize_int8_channel,
                "fp8": quantize_fp8_channel}[kind]
    first = quantize(w)
    return [first] + [tuple(t.clone() for t in first) for _ in range(count - 1)]


def _splitk_cases(kind: str, qs: list[tuple], n: int, k: int, configs: list[tuple], device):
    """(label, cfg tuple, a8, fn(x) over every copy, fn(x) on copy 0) for each runnable config."""
    counters = new_counters(n, 16, device)
    quant = {"int4": QUANT_INT4, "int8": QUANT_CHANNEL, "fp8": QUANT_FP8_A8}[kind]
    repacked: dict[int, list[tuple]] = {}
    for bn, bk, dot, warps, stages, *asm in configs:
        cfg = SplitKConfig(bn, bk, split_for(n, k, bn, bk), dot, warps, stages, *asm)
        if check_config(quant, cfg, 1, n, k, GROUP) is not None:
            continue
        if kind == "int4":
            ops = repacked.setdefault(bk, [(repack_int4(p, bk), repack_groups(s), repack_groups(z)) for p, s, z in qs])
        else:
            ops = [(q, s, None) for q, s in qs]
        one = lambda x, cfg=cfg, op=ops[0]: splitk_gemm(quant, x, *op, group=GROUP, config=cfg, counters=counters)  # noqa: E731
        every = lambda x, cfg=cfg, ops=ops: [splitk_gemm(quant, x, *op, group=GROUP, config=cfg, counters=counters)  # noqa: E731
                                             for op in ops]
        yield "splitk" + ("-a8" if kind == "fp8" else ""), tuple(cfg), kind == "fp8", every, one


def _peers(kind: str, qs: list[tuple], device) -> dict:
    """backend -> (fn(x) over every copy, max rows or None)."""
    peers = {}
    if kind == "int4":
        tg = [int4_tinygemm.pack(p, s, z) for p, s, z in qs] if device.type == "cuda" else []
        if tg:
            peers["tinygemm"] = (lambda x: [int4_tinygemm.matmul(x, w, sz, GROUP) for w, sz in tg], None)
        peers["qgemv"] = (lambda x: [qgemv(PLAIN, QG_INT4, x, p, s, z, group=GROUP) for p, s, z in qs], 4)
        peers["dense"] = (lambda x: [F.linear(x, dequantize_int4(p, s, z, DT, GROUP)) for p, s, z in qs], None)
    else:
        peers["qgemv"] = (lambda x: [qgemv(PLAIN, QG_CHANNEL, x, q, s) for q, s in qs], 4)
        if kind == "int8":
            peers["dense"] = (lambda x: [F.linear(x, dequantize_channel(q, s, DT)) for q, s in qs], None)
        elif device.type == "cuda":
            def fp8_mm(x):
                out = []
                for q, s in qs:
                    xq, xs = per_token_quant_fp8(x)
                    out.append(torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=DT,
                                                use_fast_accum=True))
                return out
            peers["dense"] = (fp8_mm, None)
    return peers


def bench_shape(model: str, shape: str, n: int, k: int, device, bw: float, smoke: bool) -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=DT, device=device).mul_(k ** -0.5)
    xs = {m: torch.randn(m, k, dtype=DT, device=device) for m in MS}
    rows = []
    ws = [w] + [w.clone() for _ in range(layers_for(weight_bytes("bf16", n, k), cap=8) - 1)]
    for m in MS:
        sec = time_call(lambda m=m: [F.linear(xs[m], c) for c in ws], device) / len(ws)
        rows.append(_row(model, shape, m, "bf16", "cublas", "bf16 cublas", sec, weight_bytes("bf16", n, k), bw))
    del ws
    for kind in ("int4", "int8", "fp8"):
        nbytes = weight_bytes(kind, n, k)
        qs = _copies(kind, w, layers_for(nbytes, cap=16))
        for backend, (fn, max_rows) in _peers(kind, qs, device).items():
            for m in MS:
                if max_rows is None or m <= max_rows:
                    sec = time_call(lambda fn=fn, m=m: fn(xs[m]), device) / len(qs)
                    rows.append(_row(model, shape, m, kind, backend, backend, sec, nbytes, bw))
        w0 = (dequantize_int4(*qs[0], torch.float32, GROUP) if kind == "int4" else
              qs[0][0].float() * qs[0][1].float()[:, None])
        for backend, cfg, a8, every, one in _splitk_cases(kind, qs, n, k, (SMOKE_CONFIGS if smoke else CONFIGS)[kind],
                                                          device):
            label = (f"{backend}(n{cfg[0]},k{cfg[1]},s{cfg[2]},{'dot' if cfg[3] else 'fma'},w{cfg[4]},st{cfg[5]}"
                     f"{'' if cfg[6] or kind != 'int4' else ',no-asm'})")
            x_err = xs[MS[-1]] if cfg[3] else xs[1]
            x_ref = quantize_act_blocks_ref(x_err, cfg[1]) if a8 else x_err.float()   # W8A8: x quantized too
            err = _rel(one(x_err), x_ref @ w0.t())
            for m in MS:
                if cfg[3] or m <= 4:
                    sec = time_call(lambda every=every, m=m: every(xs[m]), device) / len(qs)
                    rows.append(_row(model, shape, m, kind, "splitk", label, sec, nbytes, bw, cfg, a8=a8, err=err))
        del qs
    return rows


def table_from(rows: list[dict]) -> dict:
    """The kernel table: per (kind, shape) the fastest backend per M bucket; int4's split-K
    configs share the tile with the least total time over the buckets."""
    from tokenforge.model.quant.kernel_plan import table_key  # noqa: PLC0415

    entries = {}
    good = [r for r in rows if "error" not in r and r["kind"] != "bf16" and r.get("err", 0) < 2e-2]
    for key in sorted({(r["kind"], r["model"], r["shape"]) for r in good}):
        cand = [r for r in good if (r["kind"], r["model"], r["shape"]) == key]
        n, k = SHAPES[key[1]][key[2]]
        tiles = sorted({r["config"][1] for r in cand if r["backend"] == "splitk"}) if key[0] == "int4" else [None]

        def best(m: int, tile):
            ok = [r for r in cand if r["M"] == m and (r["backend"] != "splitk" or tile is None or r["config"][1] == tile)]
            return min(ok, key=lambda r: r["us"]) if ok else None

        tile = min(tiles or [None], key=lambda t: sum(best(m, t)["us"] for m in MS if best(m, t)))
        picks = {m: best(m, tile) for m in MS}
        entry_rows = {str(m): ([p["backend"], p["config"], p.get("a8", False)] if p["backend"] == "splitk"
                               else [p["backend"]]) for m, p in picks.items() if p}
        entries[table_key(key[0], n, k, GROUP)] = {
            "tile": tile, "rows": entry_rows, "us": {str(m): round(p["us"], 2) for m, p in picks.items() if p},
            "frac_of_read_bw": {str(m): round(p["frac_of_read_bw"], 3) for m, p in picks.items() if p}}
    return entries


def run(out_dir: str, smoke: bool = False) -> dict:
    device, bw, result = start_run(out_dir, smoke, " --part quant_sweep")
    global SHAPES  # noqa: PLW0603 - the smoke run swaps in tiny shapes
    if smoke:
        SHAPES = {"tiny": {"a": (48, 256)}}
    result["rows"] = []
    for model, shapes in SHAPES.items():
        for shape, (n, k) in shapes.items():
            result["rows"] += guarded(lambda model=model, shape=shape, n=n, k=k:
                                      bench_shape(model, shape, n, k, device, bw, smoke), f"{model} {shape}")
            table = _save(out_dir, result)      # after every shape: a run cut short keeps what it measured
    print_table(result, table)
    return result


def _save(out_dir: str, result: dict) -> dict:
    table = {"comment": f"measured by `tokenforge bench kernels --part quant_sweep` on {result['device']}, "
                        f"commit {result['git_commit']}; HBM read {result['hbm_read_GBps']:.0f} GB/s",
             "entries": table_from([r for r in result["rows"] if "error" not in r])}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_qsweep.json").write_text(json.dumps(result, indent=1))
    (out / "quant_table.json").write_text(json.dumps(table, indent=1))
    return table


def print_table(r: dict, table: dict) -> None:
    print(f"\n{r['device']}  HBM read {r['hbm_read_GBps']:.0f} GB/s")
    best: dict[tuple, dict] = {}
    for row in r["rows"]:
        if "error" not in row:
            key = (row["model"], row["shape"], row["M"], row["kind"], row["backend"])
            if key not in best or row["us"] < best[key]["us"]:
                best[key] = row
    for (model, shape, m, kind, backend), row in sorted(best.items()):
        print(f"{model:<4} {shape:<8} M={m:<3} {kind:<5} {backend:<9} {row['us']:8.2f} us {row['GBps']:7.0f} GB/s "
              f"{100 * row['frac_of_read_bw']:5.1f}%  {row['variant'] if backend == 'splitk' else ''}")
    for key, entry in table["entries"].items():
        print(f"table {key:<26} tile {entry['tile']}  {entry['rows']}")
