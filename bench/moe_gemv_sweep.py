"""Round 7 of issue 24: the MXFP4 per-pair GEMV (kernels/moe_gemv.py) on the gpt-oss shapes, one H200.

    [MOE_SWEEP_QUICK=1] python3 bench/moe_gemv_sweep.py OUT [--tiles-file TILE.txt]

The engine's MoE step from router logits (`bench.kernels.moe.engine_step`: the gate-up GEMV,
the down GEMV, the sum over k; routing in the GEMV programs, or before them in `route_align`'s
one launch as round 7a ran), each call its own CUDA graph, replayed over 3 weight sets (more than
the L2), for candidate GEMV tiles at T = 1, 2, 4, 8, 16 (gpt-oss-20b) and T = 1, 4
(gpt-oss-120b), the grouped GEMMs at T >= 4, and at T = 1 the first tile with the MoE launches'
programmatic dependent launch off (`moe_gemv.MOE_PDL`). MOE_SWEEP_QUICK=1 (round 7b): two tiles,
T = 1, 4, 16 and 1, the GEMVs after `route_align` for comparison, and a gpt-oss-order
(top-k then softmax) check of the routed GEMVs. Each row: us, fraction of the measured read rate (bytes of the experts the
batch selects, 17 bytes per 32 values), and the error against `moe_reference`. Out:
OUT/moe_gemv_sweep.json; with --tiles-file, the best T = 1 tile as "BLOCK_N BLOCK_K WARPS" and the
largest pair count up to which the GEMV beat the grouped GEMMs at every batch, as "PAIRS".
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from tokenforge.bench.kernels.common import start_run
from tokenforge.bench.kernels.moe import SHAPES, _graph_time, _mxfp4_experts, engine_step
from tokenforge.bench.kernels.moe_tiles import MXFP4_GEMV_TILES
from tokenforge.kernels import moe_gemv
from tokenforge.kernels.moe import fused_moe, moe_reference, route
from tokenforge.kernels.moe_routing import fused_moe_from_logits, route_align

QUICK = bool(os.environ.get("MOE_SWEEP_QUICK"))     # round 7b: two tiles, the routing A/B, fewer batches
TILES = MXFP4_GEMV_TILES[:1] + MXFP4_GEMV_TILES[2:3] if QUICK else MXFP4_GEMV_TILES
BATCHES = ({"gpt-oss-20b": (1, 4, 16), "gpt-oss-120b": (1,)} if QUICK else
           {"gpt-oss-20b": (1, 2, 4, 8, 16), "gpt-oss-120b": (1, 4)})


def _aligned_gemv(x, logits, w13, w2, k, tile):
    """The GEMV path as round 7a ran it: `route_align` (one launch), then the GEMVs on its ids."""
    weights, ids, *alignment = route_align(logits, k, "softmax_topk", True, 16)
    return fused_moe(x, w13, w2, weights, ids, alignment=tuple(alignment), all_local=True, tile=tile, gemv=True)


def _variants(t: int) -> list:
    """(label, tile, gemv flag, MoE PDL, step function or None for engine_step)."""
    out = [("gemv", tile, True, True, None) for tile in TILES]
    if QUICK:
        out.append(("gemv-route-align", TILES[0], True, True, _aligned_gemv))
    if t >= 4:
        out.append(("grouped", None, False, True, None))
    if t == 1:
        out.append(("gemv-no-moe-pdl", TILES[0], True, False, None))
    return out


def _case(name: str, experts, t: int, bw: float, device) -> list[dict]:
    h, i, e, k = SHAPES[name]
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
    logits = torch.randn(t, e, device=device)
    weights, ids = route(logits, k)
    ref = moe_reference(x, *experts[0], weights, ids).float()
    nbytes = ids.unique().numel() * 3 * h * i * 17 / 32
    rows = []
    for kind, tile, gemv, pdl, fn in _variants(t):
        moe_gemv.MOE_PDL = pdl
        step = fn or (lambda x, logits, w13, w2, k, tile, gemv=gemv: engine_step(
            x, logits, w13, w2, k, all_local=True, tile=tile, gemv=gemv))
        try:
            out = step(x, logits, *experts[0], k, tile).float()
            err = ((out - ref).norm() / ref.norm()).item()
            us = 1e6 * _graph_time([lambda s=s: step(x, logits, *experts[s], k, tile) for s in range(len(experts))],
                                   repeats=40)
        except Exception as exc:  # noqa: BLE001 - a tile that cannot launch is a result too
            rows.append({"shape": name, "tokens": t, "path": kind, "tile": list(tile or ()), "error": repr(exc)[:300]})
            print(f"{name:13s} T={t:<3d} {kind:16s} {tile} error {exc!r:.120}", flush=True)
            continue
        finally:
            moe_gemv.MOE_PDL = True
        frac = nbytes / (us * 1e-6) / bw
        rows.append({"shape": name, "tokens": t, "path": kind, "tile": list(tile or ()), "us": us,
                     "frac_of_read": frac, "rel_err": err})
        print(f"{name:13s} T={t:<3d} {kind:16s} {str(tile):20s} {us:8.1f} us {frac:6.1%} of read  err {err:.1e}",
              flush=True)
    if QUICK:                                   # gpt-oss's own routing order through the routed GEMVs
        weights, ids = route(logits, k, "topk_softmax", False)
        ref = moe_reference(x, *experts[0], weights, ids).float()
        out = fused_moe_from_logits(x, logits, *experts[0], k, "topk_softmax", False, all_local=True).float()
        err = ((out - ref).norm() / ref.norm()).item()
        rows.append({"shape": name, "tokens": t, "path": "check-topk_softmax", "rel_err": err})
        print(f"{name:13s} T={t:<3d} topk_softmax routed GEMVs against the reference: err {err:.1e}", flush=True)
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
