#!/usr/bin/env bash
# Issue 8 (weight quantization and pruning) on one H200, <= 5 minutes:
#   bash bench/gpu/issue8.sh OUTDIR
# 1. quantized-kernel micro-bench per Llama-3.1-8B GEMV shape (bf16 vs int8 vs int4 at M = 1, with a
#    tile sweep; dequant + cuBLAS and fp8 _scaled_mm at larger M);
# 2. (last, in the time left) GPU tests: kernels vs torch references, greedy graphs on == off per mode;
# 3. W1 (batch 1, 128/256) bf16, int8, int4 and W2 (256/256, fewer prompts: 400 instead of 1000,
#    to fit the time) bf16 and fp8, each through `tokenforge bench latency|throughput --quantization`.
# Writes OUTDIR/issue8.json (all figures) and prints a table. No extra packages (compressed-tensors
# is only needed by the CPU tests).
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${1:?usage: bash bench/gpu/issue8.sh OUTDIR}
mkdir -p "$OUT"
T0=$(date +%s)

TF="python3 -m tokenforge.cli bench"
COMMON="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 4096 --no-baseline"
BUDGET=${ISSUE8_BUDGET_S:-320}
# run NAME MAX_SECONDS CMD...: skipped once the budget is spent; never longer than what is left
run() {
  local name=$1 max=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 30 ]; then echo "SKIPPED (time budget): $name"; return 0; fi
  [ "$max" -gt "$left" ] && max=$left
  echo "=== $name (at $(( $(date +%s) - T0 ))s, limit ${max}s)"
  timeout "$max" "$@" || echo "FAILED or timed out: $name"
  summarize
}
summarize() {
python3 - "$OUT" <<'PY' || true
import glob, json, os, sys
out = sys.argv[1]
res = {"kernels": None, "W1": {}, "W2": {}, "tests": open(f"{out}/tests.txt").read()[-2000:] if os.path.exists(f"{out}/tests.txt") else None}
k = f"{out}/kernels/kernels_quant.json"
if os.path.exists(k):
    res["kernels"] = json.load(open(k))
for w in ("W1", "W2"):
    for d in glob.glob(f"{out}/{w.lower()}-*"):
        files = glob.glob(f"{d}/*.json")
        if files:
            r = json.load(open(files[0]))
            res[w][d.rsplit("-", 1)[1]] = {"output_tok_s": r["tokenforge"]["output_tok_s"], "weights": r.get("weights"),
                                           "ms_per_token_p50": r["tokenforge"].get("ms_per_token_p50"),
                                           "roofline_frac": r.get("roofline_frac"), "mfu": r.get("mfu")}
for w, peer in (("W1", "none"), ("W2", "none")):
    base = res[w].get(peer, {}).get("output_tok_s")
    for name, fig in res[w].items():
        fig["x_bf16"] = fig["output_tok_s"] / base if base else None
json.dump(res, open(f"{out}/issue8.json", "w"), indent=1)
print(f"{'bench':<6}{'mode':<8}{'tok/s':>12}{'x bf16':>9}  target")
targets = {("W1", "int8"): 1.7, ("W1", "int4"): 2.5, ("W2", "fp8"): 1.4}
for w in ("W1", "W2"):
    for name, fig in sorted(res[w].items()):
        t = targets.get((w, name))
        x = fig["x_bf16"]
        print(f"{w:<6}{name:<8}{fig['output_tok_s']:>12.1f}{(x or 0):>9.2f}  "
              + (f">= {t} {'MET' if x and x >= t else 'short'}" if t else ""))
PY

}

run "kernel micro-bench" 50 bash -c "python3 -m tokenforge.bench.kernels_quant '$OUT/kernels' 2>&1 | grep -E '^M=|GB/s|ERROR' | head -80"
for q in none int8 int4; do
  flag=""; [ "$q" != none ] && flag="--quantization $q --quick-ceilings"   # ceilings: measured in the bf16 run
  run "W1 $q" 75 bash -c "$TF latency $COMMON $flag --repeats 1 --results-dir '$OUT/w1-$q' 2>&1 | tail -8"
done
for q in none fp8; do
  flag=""; [ "$q" != none ] && flag="--quantization $q --quick-ceilings"
  run "W2 $q" 90 bash -c "$TF throughput $COMMON $flag --workload W2 --num-prompts 400 --repeats 1 --sweep '' \
    --results-dir '$OUT/w2-$q' 2>&1 | tail -8"
done
run "GPU tests" 120 bash -c "python3 -m pytest -q -m gpu tests/kernels/test_quant_gemv.py tests/model/test_quant_gpu.py \
  -p no:cacheprovider 2>&1 | tail -25 | tee '$OUT/tests.txt'"
run "W1 int4 + lm_head" 75 bash -c "$TF latency $COMMON --quantization int4 --quantize-lm-head --quick-ceilings \
  --repeats 1 --results-dir '$OUT/w1-int4lm' 2>&1 | tail -8"
echo "=== done at $(( $(date +%s) - T0 ))s"
