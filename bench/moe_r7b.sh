#!/usr/bin/env bash
# Issue 24, round 7b on one H200 in about 2.5 minutes (BUDGET seconds, default 150; the last step is skipped
# when the budget is spent):
#   1. GPU tests of the MXFP4 GEMV: tests/kernels/test_moe.py -k "mxfp4 or gemv", tests/model/test_moe_no_host_sync.py
#   2. MOE_SWEEP_QUICK=1 bench/moe_gemv_sweep.py: the MoE step with the GEMVs routing their own pairs against
#      route_align + GEMVs (round 7a), two tiles, MoE PDL off, a top-k-then-softmax check; its best T = 1 tile
#      and GEMV pair limit are written into kernels/moe_gemv.py (this copy only)
#   3. W1 of gpt-oss-20b and gpt-oss-120b, then gpt-oss-20b again with moe_gemv.MOE_PDL = False
#   bash bench/moe_r7b.sh "$OUT"
NAME=moe_r7b; BUDGET=${BUDGET:-150}; STEP_TAIL=30
source "$(dirname "$0")/device_steps.sh" "$@"
step tests 35 python3 -m pytest -q -x --timeout 30 -p no:cacheprovider tests/kernels/test_moe.py -k "mxfp4 or gemv" \
  tests/model/test_moe_no_host_sync.py
export MOE_SWEEP_QUICK=1
step sweep 40 python3 bench/moe_gemv_sweep.py "$W/sweep" --tiles-file "$W/tile.txt"
if [ -s "$W/tile.txt" ]; then
  read -r BN BK WARPS < <(head -1 "$W/tile.txt"); PAIRS=$(sed -n 2p "$W/tile.txt")
  sed -i "s/^GEMV_PAIRS = {\"mxfp4\": [0-9]*/GEMV_PAIRS = {\"mxfp4\": $PAIRS/; s/^GEMV_TILES = {\"mxfp4\": ([0-9, ]*)/GEMV_TILES = {\"mxfp4\": ($BN, $BK, $WARPS, 1)/" \
    tokenforge/kernels/moe_gemv.py
fi
grep -n "^GEMV_\|^MOE_PDL" tokenforge/kernels/moe_gemv.py | tee -a "$LOG"
W1="--load-format dummy --dtype bfloat16 --max-model-len 4096 --no-baseline --repeats 1 --quick-ceilings"
step w1-gpt-oss-20b 40 python3 -m tokenforge.bench latency --model gpt-oss-20b $W1 --results-dir "$W/w1-gpt-oss-20b"
step w1-gpt-oss-120b 35 python3 -m tokenforge.bench latency --model gpt-oss-120b $W1 --results-dir "$W/w1-gpt-oss-120b"
sed -i 's/^MOE_PDL = True/MOE_PDL = False/' tokenforge/kernels/moe_gemv.py
step w1-gpt-oss-20b-no-moe-pdl 40 python3 -m tokenforge.bench latency --model gpt-oss-20b $W1 \
  --results-dir "$W/w1-gpt-oss-20b-no-moe-pdl"
echo "== W1 summary" | tee -a "$LOG"
python3 - "$W" <<'PY' | tee -a "$LOG"
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/w1-*/*.json")):
    d = json.load(open(f)); t = d.get("tokenforge", {})
    print(f"{f.split('/')[-2]:28s} {t.get('output_tok_s', float('nan')):7.1f} tok/s  {t.get('ms_per_token_p50', float('nan')):6.3f} ms/tok"
          f"  {100 * d.get('roofline_frac', float('nan')):5.1f}% of roofline")
PY
cp "$W/sweep/moe_gemv_sweep.json" "$OUT/" 2>/dev/null
for d in "$W"/w1-*; do cp "$(ls "$d"/*.json 2>/dev/null | head -1)" "$OUT/W1-${d##*/w1-}.json" 2>/dev/null; done
tar czf "$OUT/moe_r7b.tgz" -C "$W" . 2>/dev/null
echo "total $(( $(date +%s) - START ))s" | tee -a "$LOG"
