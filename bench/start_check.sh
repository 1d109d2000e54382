#!/usr/bin/env bash
# Start-up on one H200 (issue 26 item 3) in about 7 minutes (BUDGET seconds, default 400):
#   1. tests: tests/executor/test_staged_graphs_gpu.py (deferred buckets eager, then graphs, same tokens, no
#      compile on a request's path), tests/executor/test_compile_watch_gpu.py and tests/executor/test_release.py
#      (three engines built and shut down in one process give their memory back)
#   2. W10: `tokenforge bench coldstart` (a real 8B safetensors checkpoint written on the device, cold once,
#      then warm twice with the engine cache the cold start filled), with each start's log lines
#   3. W1 (128 in / 256 out, batch 1, dummy bf16 Llama-3.1-8B): CUDA graphs still serve batch 1
#   bash bench/start_check.sh "$OUT"
# Out: $OUT/start_check.log (every step's tail and the W10 summary), $OUT/start_check.tgz (logs and JSONs).
NAME=start_check; BUDGET=${BUDGET:-400}
source "$(dirname "$0")/device_steps.sh" "$@"
step tests 110 python3 -m pytest -q --timeout 70 -p no:cacheprovider tests/executor/test_staged_graphs_gpu.py \
  tests/executor/test_compile_watch_gpu.py tests/executor/test_release.py
step w10 200 python3 -m tokenforge.bench coldstart --model llama-3.1-8b --checkpoint-dir /tmp/w10-ckpt \
  --cache-dir /tmp/w10-cache --serve-args "--max-model-len 4096" --warm-runs 2 --results-dir "$W/w10"
step w1 75 python3 -m tokenforge.bench latency --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
  --max-model-len 4096 --no-baseline --repeats 1 --quick-ceilings --results-dir "$W/w1"
echo "== W10 and W1 summary" | tee -a "$LOG"
python3 - "$W" <<'PY' | tee -a "$LOG"
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/w10/*.json")):
    d = json.load(open(f))
    for name, runs in (("cold", [d.get("cold") or {}]), ("warm", d.get("warm") or [])):
        for r in runs:
            print(f"W10 {name}: {r.get('seconds')} s to /health 200; phases: {r.get('phases')}")
            for line in r.get("log", []):
                print("    " + line)
for f in sorted(glob.glob(f"{sys.argv[1]}/w1/*.json")):
    d = json.load(open(f)); t = d.get("tokenforge", {})
    print(f"W1 {t.get('output_tok_s', float('nan')):.1f} tok/s, {t.get('ms_per_token_p50', float('nan')):.2f} ms/tok, "
          f"{100 * d.get('roofline_frac', float('nan')):.1f}% of roofline")
PY
grep -hE "captured [0-9]+ CUDA graphs|deferred buckets captured|start-up:" "$W"/w1.log 2>/dev/null | tail -3 >>"$LOG"
cp "$W"/w10/*.json "$W"/w1/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT/start_check.tgz" -C "$W" . 2>/dev/null
echo "total $(( $(date +%s) - START ))s" | tee -a "$LOG"
