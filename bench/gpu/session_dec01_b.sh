#!/usr/bin/env bash
# 2026-12-01 device call B (one H200, <= 9.5 min): issue 8 after the int4 revert.
#   bash bench/gpu/session_dec01_b.sh OUTDIR
# 1. quantized GEMV micro-bench (int4 interleaved vs split, int8 tiles);
# 2. GPU tests of the quantized kernels and graphs == eager per mode (2:4 fix of fae58ce unrun);
# 3. W1 bf16 / int8 / int4 in one run each (no peer);
# 4. W2 bf16 and fp8 (1000 x 256/256), back to back: the fp8 target and the W2 regression check;
# 5. W8 with fp8 weights and fp8 KV (2000 x 128/128), target >= 28,000 output tok/s.
set -uo pipefail
OUT=${1:?out dir}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
T0=$(date +%s)
at() { echo "=== $1 at $(( $(date +%s) - T0 ))s"; }
B="python3 -m tokenforge.cli bench"
M="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --no-baseline"
at kernels
timeout 80 python3 -m tokenforge.bench.kernels_quant "$OUT/kernels" > "$OUT/kernels.log" 2>&1
grep -E "^M=1 .*(int4|int8  qgemv\(8,512)" "$OUT/kernels.log" | head -40
at "GPU tests"
timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_quant_gemv.py tests/model/test_quant_gpu.py \
  -p no:cacheprovider > "$OUT/tests.txt" 2>&1; tail -4 "$OUT/tests.txt"
for q in none int8 int4; do
  at "W1 $q"; flag=""; [ "$q" != none ] && flag="--quantization $q"
  timeout 60 $B latency $M --max-model-len 4096 $flag --repeats 1 --quick-ceilings --results-dir "$OUT/w1-$q" > "$OUT/w1-$q.log" 2>&1
  grep -A3 "^variant" "$OUT/w1-$q.log" | tail -2
done
for q in none fp8; do
  at "W2 $q"; flag=""; [ "$q" != none ] && flag="--quantization $q"
  timeout 100 $B throughput $M --max-model-len 4096 --workload W2 $flag --repeats 1 --sweep '' --quick-ceilings \
    --results-dir "$OUT/w2-$q" > "$OUT/w2-$q.log" 2>&1
  grep -A3 "^variant" "$OUT/w2-$q.log" | tail -2
done
at "W8 fp8 weights + fp8 KV"
timeout 100 $B throughput $M --max-model-len 512 --workload W8 --quantization fp8 --kv-cache-dtype fp8 --repeats 1 \
  --sweep '' --quick-ceilings --results-dir "$OUT/w8" > "$OUT/w8.log" 2>&1
grep -A3 "^variant" "$OUT/w8.log" | tail -3
at done
