"""Issue 24: the MoE decode step on the four shipped MoE shapes, the grouped GEMMs against the per-pair GEMVs.

    python3 bench/moe_gemv_sweep.py OUT [--write-tables] [--shapes gpt-oss-20b,...] [--batches 1,2,4,8,16] [--fp8]
    python3 bench/moe_gemv_sweep.py OUT --cpu-smoke      (Triton's interpreter on the CPU: tiny shapes, no timing)
    python3 bench/moe_gemv_sweep.py --apply-tables OUT/moe_gemv_sweep.json    (a device run's tables into this tree)

The engine's MoE step from router logits (`bench.kernels.moe.engine_step`: routed in the GEMVs at
batch 1, after `route_align` above), each call its own CUDA graph, replayed over 3 weight sets (more
than the L2), at T = 1, 2, 4, 8, 16:
- gpt-oss-20b / 120b, MXFP4 experts: the per-pair GEMVs (kernels/moe_gemv.py) and `topk_sum`;
- qwen3-30b-a3b / mixtral-8x7b, bf16 experts (and fp8, `--fp8`): "grouped" = the grouped GEMMs and
  `topk_sum` (the shipped path), "gemv" = the per-pair GEMVs and `topk_sum`;
- at T = 1 also the GEMVs after `route_align` instead of routed in the GEMVs ("gemv-route-align").
Each row: us, the fraction of the measured HBM read rate for the bytes of the experts the batch
selects (MXFP4 17 bytes per 32 values, fp8 1, bf16 2), and the error against `moe_reference`.
Out: OUT/moe_gemv_sweep.json, rewritten after each shape, with `tables`: the GEMV_PAIRS_BY_SHAPE and
ROUTED_GEMV_EXPERTS entries the measurements support. --write-tables writes them into
tokenforge/kernels/ of this copy (the device script's W1 runs then use them).
(Round 8's folded down GEMV, its EARLY_DOWN loads and the 16-bit/fp8 gate-up GEMV, with their
tile variants, were measured here on an H100, lost, and were removed: BENCHMARKS.md, "MoE sweep".)
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
from tokenforge.kernels import moe_routing  # noqa: E402
from tokenforge.kernels.moe import moe_reference, route  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 2, 4, 8, 16)
FORMATS = {"gpt-oss-20b": ("mxfp4",), "gpt-oss-120b": ("mxfp4",), "qwen3-30b-a3b": ("float", "fp8"),
           "mixtral-8x7b": ("float", "fp8")}
MAKE = {"mxfp4": (_mxfp4_experts, 17 / 32), "float": (_float_experts, 2), "fp8": (_fp8_experts, 1)}


@contextlib.contextmanager
def _state(routed=None):
    """The kernels' tables as a variant wants them, restored after."""
    saved = moe_routing.ROUTED_GEMV_TOKENS
    if routed is not None:
        moe_routing.ROUTED_GEMV_TOKENS = routed
    try:
        yield
    finally:
        moe_routing.ROUTED_GEMV_TOKENS = saved


def _variants(fmt: str, t: int) -> list[tuple[str, bool, dict]]:
    """(label, gemv flag, table state) of each variant at batch t."""
    out = [] if fmt == "mxfp4" else [("grouped", False, {})]
    out.append(("gemv", True, {}))
    if t == 1:
        out.append(("gemv-route-align", True, {"routed": 0}))        # route_align, then the GEMVs
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
    for label, gemv, state in _variants(fmt, t):
        def step(s, gemv=gemv):
            return engine_step(x, logits, *experts[s], k, all_local=True, gemv=gemv)
        row = {"shape": name, "format": fmt, "tokens": t, "path": label}
        try:
            with _state(**state):
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
    result: dict = {"GEMV_PAIRS_BY_SHAPE": {}}
    pairs = sorted({(s, f) for s, f, _, _ in ok})
    wide = [(ok[(s, f, 1, "gemv")], ok[(s, f, 1, "gemv-route-align")]) for s, f in pairs if SHAPES[s][2] > 64
            and (s, f, 1, "gemv-route-align") in ok and (s, f, 1, "gemv") in ok]
    if wide:                                    # 128 experts: routed in the GEMVs, or route_align first
        result["ROUTED_GEMV_EXPERTS"] = 128 if sum(n for n, _ in wide) <= sum(a for _, a in wide) else 64
    for s, f in pairs:                          # 16-bit / fp8: the GEMV up to the pairs it won at every batch
        if f == "mxfp4":
            continue
        h, i, e, k = SHAPES[s]
        limit = 0
        for t in BATCHES:
            gemv, grouped = ok.get((s, f, t, "gemv")), ok.get((s, f, t, "grouped"))
            if gemv is None or grouped is None or gemv >= grouped:
                break
            limit = t * k
        result["GEMV_PAIRS_BY_SHAPE"][f"{f},{h},{i},{e}"] = limit
    return result


def write_tables(result: dict, root: Path = ROOT) -> None:
    """Rewrite the table lines of kernels/moe_gemv.py and moe_routing.py under `root`."""
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
        for f in ("moe_gemv.py", "moe_routing.py"):
            (Path(tmp) / "tokenforge/kernels").mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / "tokenforge/kernels" / f, Path(tmp) / "tokenforge/kernels" / f)
        write_tables({**result, "ROUTED_GEMV_EXPERTS": 64, "GEMV_PAIRS_BY_SHAPE": {"float,2048,768,128": 16}},
                     Path(tmp))
        gemv = (Path(tmp) / "tokenforge/kernels/moe_gemv.py").read_text()
        assert '("float", 2048, 768, 128): 16}' in gemv, gemv
        assert "ROUTED_GEMV_EXPERTS = 64" in (Path(tmp) / "tokenforge/kernels/moe_routing.py").read_text()
        for f in ("moe_gemv.py", "moe_routing.py"):                                          # still Python
            compile((Path(tmp) / "tokenforge/kernels" / f).read_text(), f, "exec")


if __name__ == "__main__":
    main()
