"""Round 7 of issue 24: the MXFP4 per-pair GEMV (kernels/moe_gemv.py) on the gpt-oss shapes, one H200.

    python3 bench/moe_gemv_sweep.py OUT [--tiles-file TILE.txt]

The engine's MoE step from router logits (`bench.kernels.moe.engine_step`: route_align, gate-up
GEMV, down GEMV, the sum over k), each call its own CUDA graph, replayed over 3 weight sets (more
than the L2), for candidate GEMV tiles at T = 1, 2, 4, 8, 16 (gpt-oss-20b) and T = 1, 4
(gpt-oss-120b), the grouped GEMMs at T >= 4, and at T = 1 the table's tile with programmatic
dependent launch off. Each row: us, fraction of the measured read rate (bytes of the experts the
batch selects, 17 bytes per 32 values), and the error against `moe_reference`. Out:
OUT/moe_gemv_sweep.json; with --tiles-file, the best T = 1 tile as "BLOCK_N BLOCK_K WARPS" and the
largest pair count up to which the GEMV beat the grouped GEMMs at every batch, as "PAIRS".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tokenforge.bench.kernels.common import start_run
from tokenforge.bench.kernels.moe import SHAPES, _graph_time, _mxfp4_experts, engine_step
from tokenforge.bench.kernels.moe_tiles import MXFP4_GEMV_TILES
from tokenforge.kernels import _triton
from tokenforge.kernels.moe import moe_reference, route

TILES = MXFP4_GEMV_TILES
BATCHES = {"gpt-oss-20b": (1, 2, 4, 8, 16), "gpt-oss-120b": (1, 4)}


def _case(name: str, experts, t: int, bw: float, device) -> list[dict]:
    h, i, e, k = SHAPES[name]
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
    logits = torch.randn(t, e, device=device)
    weights, ids = route(logits, k)
    ref = moe_reference(x, *experts[0], weights, ids).float()
    nbytes = ids.unique().numel() * 3 * h * i * 17 / 32
    variants = [("gemv", tile, None) for tile in TILES]
    if t >= 4:
        variants.append(("grouped", None, False))
    if t == 1:
        variants.append(("gemv-no-pdl", TILES[0], True))
    rows = []
    for kind, tile, gemv in variants:
        gemv = True if kind.startswith("gemv") else gemv
        if kind == "gemv-no-pdl":
            _triton.set_pdl(False)
        try:
            out = engine_step(x, logits, *experts[0], k, all_local=True, tile=tile, gemv=gemv).float()
            err = ((out - ref).norm() / ref.norm()).item()
            us = 1e6 * _graph_time([lambda s=s: engine_step(x, logits, *experts[s], k, all_local=True, tile=tile,
                                                            gemv=gemv) for s in range(len(experts))], repeats=40)
        except Exception as exc:  # noqa: BLE001 - a tile that cannot launch is a result too
            rows.append({"shape": name, "tokens": t, "path": kind, "tile": list(tile or ()), "error": repr(exc)[:300]})
            print(f"{name:13s} T={t:<3d} {kind:12s} {tile} error {exc!r:.120}", flush=True)
            continue
        finally:
            _triton.set_pdl(None)
        frac = nbytes / (us * 1e-6) / bw
        rows.append({"shape": name, "tokens": t, "path": kind, "tile": list(tile or ()), "us": us,
                     "frac_of_read": frac, "rel_err": err})
        print(f"{name:13s} T={t:<3d} {kind:12s} {str(tile):20s} {us:8.1f} us {frac:6.1%} of read  err {err:.1e}",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tiles-file")
    args = ap.parse_args()
    device, bw, result = start_run(args.out, False, " (bench/moe_gemv_sweep.py)")
    rows = []
    for name, batches in BATCHES.items():
        h, i, e, _ = SHAPES[name]
        experts = [_mxfp4_experts(e, h, i, device) for _ in range(3)]
        for t in batches:
            rows += _case(name, experts, t, bw, device)
        del experts
        torch.cuda.empty_cache()
    result["rows"] = rows
    ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2]
    t1 = [r for r in ok if r["tokens"] == 1 and r["path"] == "gemv"]
    best = {}
    for r in t1:
        best[tuple(r["tile"])] = best.get(tuple(r["tile"]), 0.0) + r["us"]      # summed over both shapes
    tile = min(best, key=best.get) if best else None
    k = SHAPES["gpt-oss-20b"][3]
    pairs = 0
    for t in BATCHES["gpt-oss-20b"]:
        mine = [r["us"] for r in ok if r["shape"] == "gpt-oss-20b" and r["tokens"] == t and r["path"] == "gemv"]
        grouped = [r["us"] for r in ok if r["shape"] == "gpt-oss-20b" and r["tokens"] == t and r["path"] == "grouped"]
        if not mine or (grouped and min(grouped) <= min(mine)):
            break
        pairs = t * k
    result["best_t1_tile"], result["gemv_pairs"] = list(tile) if tile else None, pairs
    print(f"best T=1 tile {tile}; the GEMV wins up to {pairs} pairs", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "moe_gemv_sweep.json").write_text(json.dumps(result, indent=1))
    if args.tiles_file and tile:
        Path(args.tiles_file).write_text(f"{tile[0]} {tile[1]} {tile[2]}\n{pairs}\n")


if __name__ == "__main__":
    main()
