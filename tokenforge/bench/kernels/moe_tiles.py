"""Kernel micro-benchmark, the fused MoE's tiles: which (BLOCK_N, BLOCK_K, warps, stages) runs a
decode batch fastest on each real expert shape, so `kernels/moe.py`'s table can be set from data.

In: an output folder (`tokenforge bench kernels --part moe_tiles --out OUT`). Out: per shape
(bf16 experts; the gpt-oss shapes in MXFP4, as shipped) and batch (1 and 16), the engine's MoE step
(`moe.engine_step`) timed as a CUDA graph for each candidate tile of the grouped GEMMs and of the
per-pair GEMVs (kernels/moe_gemv.py; the MXFP4 shapes also at T = 4, and through the row path of
kernels/moe_rows.py, which the grouped candidates turn off), with the table's own path
and tiles first (chosen per GEMM), its fraction of the read rate, and the best, in `kernels_moe_tiles.json`. Candidates
that do not fit in shared memory fail to launch and are recorded as errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tokenforge.bench.kernels.common import start_run
from tokenforge.bench.kernels.moe import SHAPES, _float_experts, _graph_time, _mxfp4_experts, engine_step
from tokenforge.kernels import moe_rows

TILES = ((64, 128, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (64, 256, 4, 2), (128, 64, 4, 3), (64, 128, 8, 3),
         (32, 128, 2, 4))
MXFP4_TILES = ((64, 64, 8, 3), (64, 32, 4, 3), (32, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3),
               (64, 128, 4, 3))
# the per-pair GEMV path's candidates (kernels/moe_gemv.py; BLOCK_K in values)
GEMV_TILES = ((16, 256, 4, 3), (32, 128, 4, 3), (8, 512, 4, 3), (16, 512, 8, 3))
MXFP4_GEMV_TILES = ((32, 512, 4, 1), (16, 512, 4, 1), (64, 256, 4, 1), (16, 1024, 4, 1), (32, 256, 2, 1),
                    (64, 512, 8, 1))
CASES = (("mixtral-8x7b", False), ("qwen3-30b-a3b", False), ("gpt-oss-20b", True), ("gpt-oss-120b", True))


def _rows(name: str, mxfp4: bool, smoke: bool, device, bw: float) -> list[dict]:
    h, i, e, k = SHAPES[name]
    if smoke:
        h, i, e = 64, 64, min(e, 8)
    make, value_bytes = (_mxfp4_experts, 17 / 32) if mxfp4 else (_float_experts, 2)
    experts = [make(e, h, i, device) for _ in range(2 if smoke else 3)]
    rows = []
    for t in (1,) if smoke else (1, 4, 16) if mxfp4 else (1, 16):
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        logits = torch.randn(t, e, device=device)
        used = logits.topk(k, -1).indices.unique().numel()
        nbytes = used * 3 * h * i * value_bytes
        grouped = [(False, tile) for tile in (MXFP4_TILES if mxfp4 else TILES)]
        gemv = [(True, tile) for tile in (MXFP4_GEMV_TILES if mxfp4 else GEMV_TILES)]
        candidates = (grouped[:1] + gemv[:1]) if smoke else grouped + gemv
        if mxfp4:
            candidates.append(("rows", None))           # the MXFP4 row path at its own tile
        for path, tile in ((None, None), *candidates):     # None: the table's own path and tiles
            kind = "table" if path is None else "rows" if path == "rows" else "gemv" if path else "grouped"
            label = f"{name}{'-mxfp4' if mxfp4 else ''} T={t} {kind} tile={tile or 'table'}"
            gemv = None if path is None else path is True
            enabled, moe_rows.ENABLED = moe_rows.ENABLED, kind in ("table", "rows") and moe_rows.ENABLED
            try:
                seconds = _graph_time([lambda s=s: engine_step(x, logits, *experts[s], k, all_local=True, tile=tile,
                                                               gemv=gemv)
                                       for s in range(len(experts))], repeats=30)
            except Exception as exc:  # noqa: BLE001 - a tile that cannot launch is a result too
                rows.append({"case": label, "tile": list(tile or ()), "error": repr(exc)[:200]})
                print(f"{label:56s} error {exc!r:.80}", flush=True)
                continue
            finally:
                moe_rows.ENABLED = enabled
            rows.append({"case": label, "shape": name, "mxfp4": mxfp4, "tokens": t, "path": kind, "tile": list(tile or ()),
                         "table": tile is None, "us": seconds * 1e6, "frac_of_read": nbytes / seconds / bw})
            print(f"{label:56s} {seconds * 1e6:8.1f} us {nbytes / seconds / bw:6.1%} of read", flush=True)
    return rows


def run(out_dir: str, smoke: bool = False) -> dict:
    device, bw, result = start_run(out_dir, smoke, " --part moe_tiles")
    rows = []
    for name, mxfp4 in CASES:
        rows += _rows(name, mxfp4, smoke, device, bw)
        torch.cuda.empty_cache()
    best = {}
    for r in rows:
        if "us" in r:
            key = f"{r['shape']}{'-mxfp4' if r['mxfp4'] else ''} T={r['tokens']}"
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = {"path": r["path"], "tile": r["tile"] or "table", "us": r["us"],
                             "frac_of_read": r["frac_of_read"]}
    result["tiles"], result["best"] = rows, best
    for key, b in best.items():
        print(f"best {key:28s} {b['path']:7s} tile={b['tile']} {b['us']:8.1f} us {b['frac_of_read']:6.1%} of read")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "kernels_moe_tiles.json").write_text(json.dumps(result, indent=1))
    return result
