#!/usr/bin/env bash
# Issue 24, round 8 on one H200 (BUDGET seconds, default 240; a step is cut or skipped once it is spent):
#   1. GPU tests of the MoE kernels (-k "decode_gemvs or mxfp4 or fp8_matches or host_sync": the decode GEMVs
#      against the reference, a second call and a CUDA-graph replay bit for bit; MXFP4 and fp8 experts on both
#      paths) in tests/kernels/test_moe.py and test_moe_fp8.py, and tests/model/test_moe_no_host_sync.py
#   2. bench/moe_gemv_sweep.py: the MoE step, grouped GEMMs against per-pair GEMVs, T = 1, 2, 4, 8, 16, on
#      gpt-oss-20b, gpt-oss-120b (MXFP4), qwen3-30b-a3b, mixtral-8x7b (bf16); it writes the tables its rows
#      support (GEMV_PAIRS_BY_SHAPE, ROUTED_GEMV_EXPERTS) into tokenforge/kernels/ of this copy only
#      (round 8's folded down and 16-bit/fp8 gate-up GEMV, which this step measured, were removed afterwards)
#   3. W1 of the four models with those tables (mixtral-8x7b needs > 100 GB: skipped on an 80 GB card)
#   4. if budget is left (BUDGET=400): tests/model/test_moe_gpu.py -k fused (whole models, fused vs reference)
# Out: $OUT/summary.txt (tests, tables, the sweep's T = 1 rows, W1), moe_gemv_sweep.json, W1-*.json, moe_r8.log,
# moe_r8.tgz (every step's log).
#   bash bench/moe_r8.sh "$OUT"
# (a dry run of the sweep on a CPU, Triton's interpreter: python3 bench/moe_gemv_sweep.py OUT --cpu-smoke)
NAME=moe_r8; BUDGET=${BUDGET:-240}; STEP_TAIL=12
source "$(dirname "$0")/device_steps.sh" "$@"
step tests 90 python3 -m pytest -q -x --timeout 90 -p no:cacheprovider tests/kernels/test_moe.py \
  tests/kernels/test_moe_fp8.py -k "decode_gemvs or mxfp4 or fp8_matches or host_sync" \
  tests/model/test_moe_no_host_sync.py
step sweep 70 python3 bench/moe_gemv_sweep.py "$W/sweep" --write-tables
grep -n "^GEMV_PAIRS\|^ROUTED_GEMV" tokenforge/kernels/moe_{gemv,routing}.py | tee -a "$LOG"
GPU_GB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
W1="--load-format dummy --dtype bfloat16 --max-model-len 4096 --no-baseline --repeats 1 --quick-ceilings"
for M in gpt-oss-20b gpt-oss-120b qwen3-30b-a3b mixtral-8x7b; do
  if [ "$M" = mixtral-8x7b ] && [ "${GPU_GB:-0}" -lt 100000 ]; then
    echo "== w1-$M skipped: ${GPU_GB:-?} MiB on the card, 93 GB of bf16 weights" | tee -a "$LOG"; continue
  fi
  step "w1-$M" 40 python3 -m tokenforge.bench latency --model "$M" $W1 --results-dir "$W/w1-$M"
done
step model-tests 60 python3 -m pytest -q -x --timeout 60 -p no:cacheprovider tests/model/test_moe_gpu.py -k fused
cp "$W/sweep/moe_gemv_sweep.json" "$OUT/" 2>/dev/null
for d in "$W"/w1-*; do cp "$(ls "$d"/*.json 2>/dev/null | head -1)" "$OUT/W1-${d##*/w1-}.json" 2>/dev/null; done
python3 - "$W" "$OUT" <<'PY' | tee "$OUT/summary.txt" | tee -a "$LOG"
import glob, json, re, sys
w, out = sys.argv[1:]
for name in ("tests", "model-tests"):
    try:
        lines = [l for l in open(f"{w}/{name}.log").read().splitlines() if re.search(r"passed|failed|error", l)]
        print(f"{name}: {lines[-1] if lines else 'no result line'}")
    except OSError:
        print(f"{name}: not run")
try:
    sweep = json.load(open(f"{out}/moe_gemv_sweep.json"))
    print(f"HBM read {sweep['hbm_read_GBps']:.0f} GB/s; tables written: {json.dumps(sweep['tables'])}")
    rows = {(r["shape"], r["format"], r["tokens"], r["path"]): r for r in sweep["rows"] if "us" in r}
    for (shape, fmt, t, path), r in sorted(rows.items()):
        if path in ("grouped", "gemv"):
            print(f"  {shape:13s} {fmt:5s} T={t:<2d} {path:7s} {r['us']:8.1f} us {r['frac_of_read']:6.1%} of read"
                  f"  err {r['rel_err']:.1e}")
    for (shape, fmt, t, path), r in sorted(rows.items()):
        if t == 1 and path not in ("grouped", "gemv"):
            print(f"  {shape:13s} {fmt:5s} T=1  {path:26s} {r['us']:8.1f} us")
except (OSError, KeyError, ValueError) as exc:
    print(f"sweep: no result ({exc!r})")
for f in sorted(glob.glob(f"{w}/w1-*/*.json")):
    d = json.load(open(f)); t = d.get("tokenforge", {})
    print(f"W1 {f.split('/')[-2][3:]:14s} {t.get('output_tok_s', float('nan')):7.1f} tok/s "
          f"{t.get('ms_per_token_p50', float('nan')):6.3f} ms/tok "
          f"{100 * d.get('roofline_frac', float('nan')):5.1f}% of roofline")
PY
tar czf "$OUT/moe_r8.tgz" -C "$W" . 2>/dev/null
echo "total $(( $(date +%s) - START ))s" | tee -a "$LOG"
