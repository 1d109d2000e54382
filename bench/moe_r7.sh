#!/usr/bin/env bash
# Issue 24, round 7 on one H200 in about 4 minutes (BUDGET seconds, default 250):
#   1. GPU tests of the MXFP4 GEMV (inline-PTX decode, bf16 activation words, PDL): tests/kernels/test_moe.py
#      -k "mxfp4 or gemv", tests/model/test_moe_no_host_sync.py
#   2. bench/moe_gemv_sweep.py: the MoE step of gpt-oss-20b (T = 1-16) and -120b (T = 1, 4) per GEMV tile,
#      the grouped GEMMs, PDL off; its best T = 1 tile and GEMV pair limit are written into
#      kernels/moe_gemv.py's GEMV_TILES / GEMV_PAIRS (this copy only) before
#   3. W1 (128 in / 256 out, batch 1, dummy weights, bf16) of gpt-oss-20b (with --profile-dir) and gpt-oss-120b.
#   bash bench/moe_r7.sh "$OUT"
# Out: $OUT/moe_r7.log, moe_gemv_sweep.json, the two W1 JSONs, the 20b profile summary, moe_r7.tgz (all logs).
NAME=moe_r7; BUDGET=${BUDGET:-250}; STEP_TAIL=40
source "$(dirname "$0")/device_steps.sh" "$@"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader | tee -a "$LOG"
step tests 50 python3 -m pytest -q -x --timeout 45 -p no:cacheprovider tests/kernels/test_moe.py -k "mxfp4 or gemv" \
  tests/model/test_moe_no_host_sync.py
step sweep 80 python3 bench/moe_gemv_sweep.py "$W/sweep" --tiles-file "$W/tile.txt"
if [ -s "$W/tile.txt" ]; then
  read -r BN BK WARPS < <(head -1 "$W/tile.txt"); PAIRS=$(sed -n 2p "$W/tile.txt")
  sed -i "s/^GEMV_PAIRS = {\"mxfp4\": [0-9]*/GEMV_PAIRS = {\"mxfp4\": $PAIRS/; s/^GEMV_TILES = {\"mxfp4\": ([0-9, ]*)/GEMV_TILES = {\"mxfp4\": ($BN, $BK, $WARPS, 1)/" \
    tokenforge/kernels/moe_gemv.py
fi
grep -n "^GEMV_" tokenforge/kernels/moe_gemv.py | tee -a "$LOG"
W1="--load-format dummy --dtype bfloat16 --max-model-len 4096 --no-baseline --repeats 1 --quick-ceilings"
step w1-gpt-oss-20b 65 python3 -m tokenforge.bench latency --model gpt-oss-20b $W1 --results-dir "$W/w1-gpt-oss-20b" \
  --profile-dir "$W/profile-gpt-oss-20b"
step w1-gpt-oss-120b 60 python3 -m tokenforge.bench latency --model gpt-oss-120b $W1 --results-dir "$W/w1-gpt-oss-120b"
echo "== W1 summary" | tee -a "$LOG"
python3 - "$W" <<'PY' | tee -a "$LOG"
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/w1-*/*.json")):
    d = json.load(open(f)); t = d.get("tokenforge", {})
    print(f"{d.get('model', '?'):14s} {t.get('output_tok_s', float('nan')):7.1f} tok/s  {t.get('ms_per_token_p50', float('nan')):6.3f} ms/tok"
          f"  {100 * d.get('roofline_frac', float('nan')):5.1f}% of roofline")
PY
cp "$W/sweep/moe_gemv_sweep.json" "$OUT/" 2>/dev/null
for m in gpt-oss-20b gpt-oss-120b; do cp "$(ls "$W/w1-$m"/*.json 2>/dev/null | head -1)" "$OUT/W1-$m.json" 2>/dev/null; done
cp "$W/profile-gpt-oss-20b/summary.txt" "$OUT/profile-gpt-oss-20b.txt" 2>/dev/null
head -60 "$OUT/profile-gpt-oss-20b.txt" 2>/dev/null | cut -c1-60,100-200 | tee -a "$LOG" >/dev/null
tar czf "$OUT/moe_r7.tgz" -C "$W" --exclude='*.pt.trace.json*' --exclude='*.json.gz' . 2>/dev/null
echo "total $(( $(date +%s) - START ))s" | tee -a "$LOG"
