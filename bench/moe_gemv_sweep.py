"""Issue 24, round 8: the MoE decode step, the old path against the new, on the four shipped MoE shapes.

    python3 bench/moe_gemv_sweep.py OUT [--write-tables] [--shapes gpt-oss-20b,...] [--batches 1,2,4,8,16] [--fp8]
    python3 bench/moe_gemv_sweep.py OUT --cpu-smoke      (Triton's interpreter on the CPU: tiny shapes, no timing)
    python3 bench/moe_gemv_sweep.py --apply-tables OUT/moe_gemv_sweep.json    (a device run's tables into this tree)

The engine's MoE step from router logits (`bench.kernels.moe.engine_step`: routed in the GEMVs at
batch 1, after `route_align` above), each call its own CUDA graph, replayed over 3 weight sets (more
than the L2), at T = 1, 2, 4, 8, 16:
- gpt-oss-20b / 120b, MXFP4 experts: old = round 7's per-pair down GEMVs and `topk_sum`
  (moe_down.FOLD_DOWN off), new = the down GEMV that sums the k experts (kernels/moe_down.py);
- qwen3-30b-a3b / mixtral-8x7b, bf16 experts (and fp8, `--fp8`): old = the grouped GEMMs and
  `topk_sum`, new = the gate-up GEMV (kernels/moe_gemv_dense.py) and the folded down GEMV;
- at T = 1 also the new path with its first down tile loaded after griddepcontrol.wait
  (EARLY_DOWN off), after `route_align` instead of routed in the GEMVs, and (TILE_SHAPES) the other
  down tiles of ALT_DOWN_TILES and gate-up tiles of ALT_GATE_UP_TILES.
Each row: us, the fraction of the measured HBM read rate for the bytes of the experts the batch
selects (MXFP4 17 bytes per 32 values, fp8 1, bf16 2), and the error against `moe_reference`.
Out: OUT/moe_gemv_sweep.json, rewritten after each shape, with `tables`: the FOLD_DOWN, EARLY_DOWN,
DOWN_TILES, GATE_UP_TILES, GEMV_PAIRS_BY_SHAPE and ROUTED_GEMV_EXPERTS entries the measurements
support. --write-tables writes them
into tokenforge/kernels/ of this copy (the device script's W1 runs then use them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:                                       # before Triton decorates the kernels
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tokenforge.bench.kernels.common import start_run  # noqa: E402
from tokenforge.bench.kernels.moe import (SHAPES, _float_experts, _fp8_experts, _graph_time,  # noqa: E402
                                          _mxfp4_experts, engine_step)
from tokenforge.kernels import moe_down, moe_gemv_dense, moe_routing  # noqa: E402
from tokenforge.kernels.moe import moe_reference, route  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 2, 4, 8, 16)
# format -> other down tiles tried at T = 1 (DOWN_TILES' is the first)
ALT_DOWN_TILES = {"mxfp4": ((8, 32, 8), (16, 64, 16)), "float": ((8, 4096, 4), (4, 8192, 8)),
                  "fp8": ((8, 4096, 4),)}
# 16-bit / fp8 gate-up tiles tried at T = 1 (GATE_UP_TILES' is the first): fewer programs route less
ALT_GATE_UP_TILES = {"float": ((4, 512, 4), (16, 256, 8)), "fp8": ((8, 256, 4),)}
TILE_SHAPES = ("gpt-oss-20b", "qwen3-30b-a3b")     # the shapes that try ALT_DOWN_TILES (compiles cost budget)
FORMATS = {"gpt-oss-20b": ("mxfp4",), "gpt-oss-120b": ("mxfp4",), "qwen3-30b-a3b": ("float", "fp8"),
           "mixtral-8x7b": ("float", "fp8")}
MAKE = {"mxfp4": (_mxfp4_experts, 17 / 32), "float": (_float_experts, 2), "fp8": (_fp8_experts, 1)}


@contextlib.contextmanager
def _state(fold=None, early=None, down_tile=None, routed=None, gate_up_tile=None, fmt="float"):
    """The kernels' tables as a variant wants them, restored after."""
    saved = (dict(moe_down.FOLD_DOWN), moe_down.EARLY_DOWN, dict(moe_down.DOWN_TILES), moe_routing.ROUTED_GEMV_TOKENS,
             dict(moe_gemv_dense.GATE_UP_TILES))
    if gate_up_tile is not None:
        moe_gemv_dense.GATE_UP_TILES[fmt] = gate_up_tile
    if routed is not None:
        moe_routing.ROUTED_GEMV_TOKENS = routed
    if fold is not None:
        moe_down.FOLD_DOWN[fmt] = fold
    if early is not None:
        moe_down.EARLY_DOWN = early
    if down_tile is not None:
        moe_down.DOWN_TILES[fmt] = down_tile
    try:
        yield
    finally:
        moe_down.FOLD_DOWN.update(saved[0])
        moe_down.EARLY_DOWN = saved[1]
        moe_down.DOWN_TILES.update(saved[2])
        moe_routing.ROUTED_GEMV_TOKENS = saved[3]
        moe_gemv_dense.GATE_UP_TILES.update(saved[4])


def _variants(name: str, fmt: str, t: int) -> list[tuple[str, bool, dict]]:
    """(label, gemv flag, table state) of each variant at batch t."""
    old = ("old", True, {"fold": False}) if fmt == "mxfp4" else ("old", False, {})
    out = [old, ("new", True, {"fold": True})]
    if t == 1:
        out.append(("new-late", True, {"fold": True, "early": False}))
        out.append(("new-route-align", True, {"fold": True, "routed": 0}))       # route_align, then the GEMVs
        if name in TILE_SHAPES and not SMOKE:
            out += [(f"new-tile{list(t)}", True, {"fold": True, "down_tile": t}) for t in ALT_DOWN_TILES[fmt]]
            out += [(f"new-gate-up{list(t)}", True, {"fold": True, "gate_up_tile": t})
                    for t in ALT_GATE_UP_TILES.get(fmt, ())]
    return out


def _case(name: str, fmt: str, experts, shape, t: int, bw: float, device) -> list[dict]:
    h, i, e, k = shape
    gen = torch.Generator(device=device).manual_seed(t)
    x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16 if not SMOKE else torch.float32)
    logits = torch.randn(t, e, device=device, generator=gen)
    weights, ids = route(logits, k)
    ref = moe_reference(x, *experts[0], weights, ids).float()
    nbytes = ids.unique().numel() * 3 * h * i * MAKE[fmt][1]
    rows = []
    for label, gemv, state in _variants(name, fmt, t):
        def step(s, gemv=gemv):
            return engine_step(x, logits, *experts[s], k, all_local=True, gemv=gemv)
        row = {"shape": name, "format": fmt, "tokens": t, "path": label}
        try:
            with _state(fmt=fmt, **state):
                out = step(0).float()
                us = 1e6 * _graph_time([lambda s=s: step(s) for s in range(len(experts))], repeats=40)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot launch is a result too
            rows.append({**row, "error": repr(exc)[:300]})
            print(f"{name:13s} {fmt:5s} T={t:<3d} {label:26s} error {exc!r:.120}", flush=True)
            continue
        err = ((out - ref).norm() / ref.norm()).item()
        frac = nbytes / (us * 1e-6) / bw
        rows.append({**row, "us": us, "frac_of_read": frac, "rel_err": err})
        print(f"{name:13s} {fmt:5s} T={t:<3d} {label:26s} {us:8.1f} us {frac:6.1%} of read  err {err:.1e}", flush=True)
    return rows


def tables(rows: list[dict]) -> dict:
    """The table entries the rows support (only where both sides of a comparison ran clean)."""
    ok = {(r["shape"], r["format"], r["tokens"], r["path"]): r["us"] for r in rows
          if "us" in r and r["rel_err"] < 2e-2}
    result: dict = {"FOLD_DOWN": {}, "GEMV_PAIRS_BY_SHAPE": {}, "DOWN_TILES": {}, "GATE_UP_TILES": {}}
    pairs = sorted({(s, f) for s, f, _, _ in ok})
    mx = [(ok[(s, f, t, "new")], ok[(s, f, t, "old")]) for s, f, t, p in ok if f == "mxfp4" and p == "new"
          and (s, f, t, "old") in ok]
    if mx:                                      # MXFP4's old path is the unfolded GEMV
        result["FOLD_DOWN"]["mxfp4"] = sum(n for n, _ in mx) <= sum(o for _, o in mx)
    late = [(ok[(s, f, 1, "new")], ok[(s, f, 1, "new-late")]) for s, f in pairs if (s, f, 1, "new-late") in ok
            and (s, f, 1, "new") in ok]
    if late:
        result["EARLY_DOWN"] = sum(n for n, _ in late) <= sum(la for _, la in late)
    wide = [(ok[(s, f, 1, "new")], ok[(s, f, 1, "new-route-align")]) for s, f in pairs if SHAPES[s][2] > 64
            and (s, f, 1, "new-route-align") in ok and (s, f, 1, "new") in ok]
    if wide:                                    # 128 experts: routed in the GEMVs, or route_align first
        result["ROUTED_GEMV_EXPERTS"] = 128 if sum(n for n, _ in wide) <= sum(a for _, a in wide) else 64
    for fmt in ("mxfp4", "float", "fp8"):      # the best tiles at T = 1, summed over the shapes that tried them
        for key, table, alts, prefix in (("DOWN_TILES", moe_down.DOWN_TILES, ALT_DOWN_TILES, "new-tile"),
                                         ("GATE_UP_TILES", moe_gemv_dense.GATE_UP_TILES, ALT_GATE_UP_TILES,
                                          "new-gate-up")):
            if fmt not in alts:
                continue
            cands = {"new": table[fmt], **{f"{prefix}{list(t)}": t for t in alts[fmt]}}
            shapes = [s for s, f in pairs if f == fmt and all((s, f, 1, label) in ok for label in cands)]
            if shapes:
                sums = {tuple(tile): sum(ok[(s, fmt, 1, label)] for s in shapes) for label, tile in cands.items()}
                result.setdefault(key, {})[fmt] = list(min(sums, key=sums.get))
    for s, f in pairs:                          # 16-bit / fp8: the GEMV up to the pairs it won at every batch
        if f == "mxfp4":
            continue
        h, i, e, k = SHAPES[s]
        limit = 0
        for t in BATCHES:
            new, old = ok.get((s, f, t, "new")), ok.get((s, f, t, "old"))
            if new is None or old is None or new >= old:
                break
            limit = t * k
        result["GEMV_PAIRS_BY_SHAPE"][f"{f},{h},{i},{e}"] = limit
    return result


def write_tables(result: dict, root: Path = ROOT) -> None:
    """Rewrite the table lines of kernels/moe_down.py, moe_gemv.py, moe_gemv_dense.py and moe_routing.py
    under `root`."""
    down = root / "tokenforge/kernels/moe_down.py"
    src = down.read_text()
    fold = {**moe_down.FOLD_DOWN, **result["FOLD_DOWN"]}
    fold_py = json.dumps(fold).replace("true", "True").replace("false", "False")
    src = re.sub(r"^FOLD_DOWN = \{.*\}$", f"FOLD_DOWN = {fold_py}",
                 src, flags=re.M)
    if "EARLY_DOWN" in result:
        src = re.sub(r"^EARLY_DOWN = \w+$", f"EARLY_DOWN = {result['EARLY_DOWN']}", src, flags=re.M)
    tiles = {**moe_down.DOWN_TILES, **{f: tuple(t) for f, t in result["DOWN_TILES"].items()}}
    src = re.sub(r"^DOWN_TILES = \{.*\}$", "DOWN_TILES = {" + ", ".join(f'"{f}": {tuple(t)}' for f, t in tiles.items())
                 + "}", src, flags=re.M)
    down.write_text(src)
    dense = root / "tokenforge/kernels/moe_gemv_dense.py"
    tiles = {**moe_gemv_dense.GATE_UP_TILES, **{f: tuple(t) for f, t in result.get("GATE_UP_TILES", {}).items()}}
    dense.write_text(re.sub(r"^GATE_UP_TILES = \{.*\}$", "GATE_UP_TILES = {" + ", ".join(
        f'"{f}": {tuple(t)}' for f, t in tiles.items()) + "}", dense.read_text(), flags=re.M))
    if "ROUTED_GEMV_EXPERTS" in result:
        routing = root / "tokenforge/kernels/moe_routing.py"
        line = f"ROUTED_GEMV_EXPERTS = {result['ROUTED_GEMV_EXPERTS']}"
        routing.write_text(re.sub(r"^ROUTED_GEMV_EXPERTS = \d+$", line, routing.read_text(), flags=re.M))
    gemv = root / "tokenforge/kernels/moe_gemv.py"
    entries = ", ".join(f'("{key.split(",")[0]}", {", ".join(key.split(",")[1:])}): {v}'
                        for key, v in result["GEMV_PAIRS_BY_SHAPE"].items())
    gemv.write_text(re.sub(r"^GEMV_PAIRS_BY_SHAPE: (.*) = \{.*\}$", r"GEMV_PAIRS_BY_SHAPE: \1 = {" + entries + "}",
                           gemv.read_text(), flags=re.M))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--apply-tables", metavar="SWEEP_JSON", help="write a finished sweep's tables; run nothing")
    ap.add_argument("--shapes", default=",".join(FORMATS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--fp8", action="store_true", help="fp8 experts for the 16-bit shapes too")
    ap.add_argument("--write-tables", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.apply_tables:
        write_tables(json.loads(Path(args.apply_tables).read_text())["tables"])
        print(f"tables of {args.apply_tables} written into tokenforge/kernels/", flush=True)
        return
    if not args.out:
        ap.error("OUT is required")
    if SMOKE:
        from tests.kernels.test_moe_interpreter import _interpreter_compat
        _interpreter_compat()
    device, bw, result = start_run(args.out, SMOKE, " (bench/moe_gemv_sweep.py)")
    batches = (1, 2) if SMOKE else tuple(int(b) for b in args.batches.split(","))
    rows: list[dict] = []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        h, i, e, k = SHAPES[name]
        shape = (64, 64, e, k) if SMOKE else (h, i, e, k)
        for fmt in FORMATS[name] if args.fp8 or SMOKE else FORMATS[name][:1]:
            make = MAKE[fmt][0]
            experts = [make(e, shape[0], shape[1], device) for _ in range(2 if SMOKE else 3)]
            if SMOKE and fmt == "float":
                experts = [tuple(w.float() for w in ws) for ws in experts]
            for t in batches:
                rows += _case(name, fmt, experts, shape, t, bw, device)
            del experts
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["rows"], result["tables"] = rows, tables(rows)
        (Path(args.out) / "moe_gemv_sweep.json").write_text(json.dumps(result, indent=1))
        if args.write_tables:                   # after every shape: a sweep cut short by its time limit still counts
            write_tables(result["tables"])
    print(f"tables the sweep supports: {json.dumps(result['tables'])}", flush=True)
    if args.write_tables:
        print("written into tokenforge/kernels/ (this copy)", flush=True)
    if SMOKE:                                   # the rows ran clean and the table writer edits a copy sanely
        assert all("rel_err" in r and r["rel_err"] < 1e-4 for r in rows), [r for r in rows if "us" not in r][:3]
        _check_writer(result["tables"])
        print("cpu smoke ok", flush=True)


def _check_writer(result: dict) -> None:
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for f in ("moe_down.py", "moe_gemv.py", "moe_routing.py", "moe_gemv_dense.py"):
            (Path(tmp) / "tokenforge/kernels").mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / "tokenforge/kernels" / f, Path(tmp) / "tokenforge/kernels" / f)
        write_tables({**result, "EARLY_DOWN": False, "ROUTED_GEMV_EXPERTS": 64, "GATE_UP_TILES": {"fp8": [4, 512, 4]},
                      "GEMV_PAIRS_BY_SHAPE": {"float,2048,768,128": 16}}, Path(tmp))
        text = (Path(tmp) / "tokenforge/kernels/moe_down.py").read_text()
        assert "EARLY_DOWN = False" in text and re.search(r"^FOLD_DOWN = \{.*\}$", text, re.M), text[:200]
        gemv = (Path(tmp) / "tokenforge/kernels/moe_gemv.py").read_text()
        assert '("float", 2048, 768, 128): 16}' in gemv, gemv
        assert "ROUTED_GEMV_EXPERTS = 64" in (Path(tmp) / "tokenforge/kernels/moe_routing.py").read_text()
        assert '"fp8": (4, 512, 4)}' in (Path(tmp) / "tokenforge/kernels/moe_gemv_dense.py").read_text()
        for f in ("moe_down.py", "moe_gemv.py", "moe_routing.py", "moe_gemv_dense.py"):   # still Python
            compile((Path(tmp) / "tokenforge/kernels" / f).read_text(), f, "exec")


if __name__ == "__main__":
    main()
